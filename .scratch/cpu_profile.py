import torch, time
from torch.profiler import profile
from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams as SP
torch.set_num_threads(2)
V = 49152
for n, mk, name in [(256, lambda i: SP(temperature=0.8), "temp"), (256, lambda i: SP(temperature=0, logprobs=5), "greedy+lp"), (64, lambda i: SP(temperature=0.8, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.3), "topp+pen")]:
    torch.manual_seed(0)
    x = torch.randn(n, V) * 4
    prompt = torch.randint(0, V, (n, 200)).tolist(); out = torch.randint(0, V, (n, 100)).tolist()
    rows = [SamplingRow(mk(i), prompt[i], out[i], frozenset({2})) for i in range(n)]
    s = Sampler(); g = torch.Generator().manual_seed(0)
    for _ in range(3): s(x, rows, g)
    with profile() as p:
        for _ in range(5): s(x, rows, g)
    print(name, n)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
