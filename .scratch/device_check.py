"""Sampler on CUDA (correctness + timing) and CPU timing with 2 threads on a quiet host."""
import sys, time, torch
from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams as SP

V = 49152

def rows_for(mk, n, prompt, out, dev):
    rows = []
    for i in range(n):
        p = mk(i)
        g = torch.Generator(device=dev).manual_seed(p.seed) if p.seed is not None and not p.greedy else None
        rows.append(SamplingRow(p, prompt[i], out[i], frozenset({2}), g))
    return rows

def bench(name, logits, mk, n, prompt, out, dev, reps=20):
    s = Sampler(); g = torch.Generator(device=dev).manual_seed(0)
    rows = rows_for(mk, n, prompt, out, dev)
    s(logits, rows, g)
    ts = []
    for _ in range(reps):
        if dev == "cuda": torch.cuda.synchronize()
        t = time.perf_counter(); s(logits, rows, g); ts.append(time.perf_counter() - t)
    ts.sort()
    print(f"  {name:44s} median {ts[len(ts)//2]*1e3:7.2f} ms  min {ts[0]*1e3:7.2f} ms", flush=True)

CASES = [
    ("greedy", lambda i: SP(temperature=0)),
    ("greedy + logprobs=5", lambda i: SP(temperature=0, logprobs=5)),
    ("temperature 0.8", lambda i: SP(temperature=0.8)),
    ("top_k=50", lambda i: SP(temperature=0.8, top_k=50)),
    ("mixed: half greedy, half top_p+pen (1/4 seeded)", lambda i: (SP(temperature=0.8, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.5, seed=i if i % 4 == 1 else None) if i % 2 else SP(temperature=0))),
    ("all top_p=0.9 + rep/presence penalties", lambda i: SP(temperature=0.8, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.3)),
]

def run(dev, n, flat_too):
    torch.manual_seed(0)
    prompt = torch.randint(0, V, (n, 200)).tolist(); out = torch.randint(0, V, (n, 100)).tolist()
    peaked = (torch.randn(n, V) * 4).to(dev)
    print(f"{dev} N={n} V={V} threads={torch.get_num_threads()} (peaked logits, 0.9-nucleus ~30 tokens)")
    for name, mk in CASES:
        bench(name, peaked, mk, n, prompt, out, dev)
    if flat_too:
        flat = torch.randn(n, V).to(dev)
        bench("all top_p=0.9 + penalties, FLAT logits", flat, CASES[-1][1], n, prompt, out, dev)

def cuda_checks():
    dev = "cuda"
    torch.manual_seed(1)
    own = torch.randn(V, device=dev) * 2
    def draws(pos, batch, seed=7):
        logits = torch.randn(batch, V, device=dev) * 2; logits[pos] = own
        gen = torch.Generator(device=dev).manual_seed(seed)
        p = SP(temperature=0.9, top_p=0.95, min_p=0.01, seed=seed)
        res = []
        for _ in range(20):
            rows = [SamplingRow(SP(temperature=1.0, top_k=5), [], [1, 2], frozenset({2})) for _ in range(batch - 1)]
            rows.insert(pos, SamplingRow(p, [3], [4, 4], frozenset({2}), gen))
            res.append(Sampler()(logits, rows, torch.Generator(device=dev).manual_seed(batch)).token_ids[pos])
        return res
    a = draws(0, 1); b = draws(0, 5); c = draws(3, 64)
    print("cuda seeded reproducible:", a == b == c, "distinct:", len(set(a)))
    # CPU and CUDA agree on greedy and on the kept sets
    x = torch.randn(32, V) * 3
    rows = [SamplingRow(SP(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5), list(range(i, i + 50)), list(range(i, i + 9)), frozenset({2})) for i in range(32)]
    print("cuda greedy+penalties == cpu:", Sampler()(x, rows).token_ids == Sampler()(x.to(dev), rows).token_ids)
    lp_rows = [SamplingRow(SP(temperature=0.5, logprobs=3), [], [], frozenset({2})) for _ in range(4)]
    o = Sampler()(x[:4].to(dev), lp_rows)
    ref = torch.log_softmax(x[:4], -1)
    print("cuda logprobs ok:", all(abs(o.logprobs[i][0] - ref[i, o.token_ids[i]].item()) < 1e-4 and list(o.logprobs[i][1]) == ref[i].topk(3).indices.tolist() for i in range(4)))

if __name__ == "__main__":
    if torch.cuda.is_available():
        cuda_checks()
        for n in (64, 256): run("cuda", n, True)
    torch.set_num_threads(2)
    for n in (64, 256): run("cpu", n, n == 64)
