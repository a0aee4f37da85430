"""Serving LoRA adapters (vLLM's --enable-lora): flags, protos, routing, the gateway's routes over
the in-process engine, and a real disaggregated cluster (`pdserve up`: tokenizer, prefill and
decode processes, gRPC, real Redis) driven by the official openai client, whose greedy tokens
under an adapter equal the offline `LLM` under the same adapter and differ from the base's."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import grpc
import httpx
import pytest
from lora_helpers import make_adapter

from engine.block_manager import prefix_hashes
from engine.lora import LoRAInUseError, LoRARequest
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerStats
from gateway.lora import LoRAModels, MemoryCatalog
from gateway.remote_lora import WorkerAdapters
from pdserve.cluster.convert import lora_from_pb, lora_to_pb, request_lora
from pdserve.cluster.lora import LoRAModule, lora_argv, lora_int_id, parse_lora_modules
from pdserve.cluster.lora_metrics import lora_requests_info
from pdserve.cluster.registry import WorkerInfo
from pdserve.cluster.routing import pick_decode, pick_prefill
from pdserve.launcher import add_arguments, plan
from protos import common_pb2, decode_pb2, prefill_pb2

PROMPT = [1, 17, 230, 58, 901, 44, 12, 7]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
KEY = "sk-lora-test"


# ---- flags -------------------------------------------------------------------------------
def test_lora_modules_take_name_path_and_vllm_json():
    modules = parse_lora_modules(["sql=/a/sql", '{"name": "chat", "path": "/a/c d", '
                                                '"base_model_name": "llama"}'])
    assert modules == [LoRAModule("sql", "/a/sql"), LoRAModule("chat", "/a/c d", "llama")]
    # PDSERVE_LORA_MODULES: one string; a JSON object stays one item whatever spaces it holds
    env = 'sql=/a/sql  {"name": "chat", "path": "/a/c d", "base_model_name": "llama"}'
    assert parse_lora_modules(env) == modules
    assert parse_lora_modules(None) == parse_lora_modules("") == []
    for bad, why in ((["sql"], "name=path"), (["a=/x", "a=/y"], "twice"),
                     (['{"name": "a"}'], "path"), (['{"name": "a", "path": "/x", "r": 1}'],
                                                   "unknown keys"), (["=/x"], "non-empty")):
        with pytest.raises(ValueError, match=why):
            parse_lora_modules(bad)
    assert LoRAModule.from_json(modules[1].to_json()) == modules[1]


def test_lora_int_id_is_the_same_everywhere_and_valid():
    assert lora_int_id("sql") == lora_int_id("sql") != lora_int_id("chat")
    assert all(1 <= lora_int_id(n) <= 2**31 - 1 for n in ("", "a", "x" * 1000))
    assert LoRAModule("sql", "/p").request() == LoRARequest("sql", lora_int_id("sql"), "/p")


def _up(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    for name in ("ENABLE_LORA", "LORA_MODULES", "MAX_LORAS", "MAX_LORA_RANK", "MAX_CPU_LORAS",
                 "API_KEY", "COLOCATED"):
        monkeypatch.delenv(f"PDSERVE_{name}", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_up_hands_the_lora_flags_to_every_worker_and_the_gateway(monkeypatch):
    from pdserve.cli import build_parser

    args = _up(["--enable-lora", "--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b"}',
                "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5"],
               monkeypatch)
    parsed = {s.name: build_parser().parse_args(s.argv[3:])
              for s in plan(args, "redis://127.0.0.1:6379/0", None)}
    for name in ("prefill-0", "decode-0"):
        p = parsed[name]
        assert (p.enable_lora, p.max_loras, p.max_lora_rank, p.max_cpu_loras) == (True, 3, 32, 5)
        assert [m.name for m in parse_lora_modules(p.lora_modules)] == ["a", "b"]
    gateway = parsed["gateway"]
    assert gateway.enable_lora and not hasattr(gateway, "max_loras")
    assert parse_lora_modules(gateway.lora_modules) == [LoRAModule("a", "/x/a"),
                                                        LoRAModule("b", "/x/b")]
    assert not parsed["tokenizer"].__dict__.get("enable_lora")
    (serve,) = plan(_up(["--colocated", "--enable-lora", "--lora-modules", "a=/x/a"],
                        monkeypatch), "", None)
    s = build_parser().parse_args(serve.argv[3:])
    assert s.enable_lora and s.max_loras == 1 and s.lora_modules == [LoRAModule(
        "a", "/x/a").to_json()]
    # without --enable-lora nothing is passed on; modules alone are refused
    assert lora_argv(_up([], monkeypatch)) == []
    with pytest.raises(ValueError, match="needs --enable-lora"):
        lora_argv(_up(["--lora-modules", "a=/x"], monkeypatch))


def test_worker_flags_fall_back_to_the_environment(monkeypatch):
    from prefill_svc.server import add_arguments as prefill_arguments

    monkeypatch.setenv("PDSERVE_ENABLE_LORA", "1")
    monkeypatch.setenv("PDSERVE_LORA_MODULES", 'a=/x/a {"name": "b", "path": "/x/b"}')
    monkeypatch.setenv("PDSERVE_MAX_LORAS", "2")
    parser = argparse.ArgumentParser()
    prefill_arguments(parser)
    args = parser.parse_args([])
    assert args.enable_lora and args.max_loras == 2 and args.max_cpu_loras is None
    assert [m.name for m in parse_lora_modules(args.lora_modules)] == ["a", "b"]


# ---- protos and routing ------------------------------------------------------------------
def test_the_adapter_travels_in_prefill_and_generate_requests():
    lora = LoRARequest("sql", 7, "/adapters/sql")
    assert lora_from_pb(lora_to_pb(lora)) == lora
    assert lora_from_pb(common_pb2.LoRAAdapter(name="sql", path="/p")).lora_int_id == \
        lora_int_id("sql")  # a client leaving int_id out
    for msg in (prefill_pb2.PrefillRequest(request_id="r", lora=lora_to_pb(lora)),
                decode_pb2.GenerateRequest(request_id="r", lora=lora_to_pb(lora))):
        assert request_lora(type(msg).FromString(msg.SerializeToString())) == lora
    assert request_lora(prefill_pb2.PrefillRequest(request_id="r")) is None
    with pytest.raises(ValueError, match="lora_path"):
        lora_from_pb(common_pb2.LoRAAdapter(name="sql"))


def _worker(role: str, n: int, queue: int = 0, free: int = 100, loras: tuple = ()) -> WorkerInfo:
    return WorkerInfo(f"{role}-{n}", role, f"h:{n}", num_waiting=queue, num_free_blocks=free,
                      num_total_blocks=100, lora_adapters=list(loras))


def test_routing_prefers_workers_holding_the_adapter_against_load():
    p0, p1 = _worker("prefill", 0), _worker("prefill", 1, queue=2, loras=("a",))
    assert pick_prefill([p0, p1]) is p0  # base model: the shorter queue, as before
    assert pick_prefill([p0, p1], lora="a") is p1  # 0.5 - 2/6 > 0
    assert pick_prefill([p0, p1], lora="b") is p0
    busy = _worker("prefill", 1, queue=5, loras=("a",))
    assert pick_prefill([p0, busy], lora="a") is p0  # 0.5 - 5/9 < 0: load wins
    d0, d1 = _worker("decode", 0, free=90), _worker("decode", 1, free=80, loras=("a",))
    assert pick_decode([d0, d1]) is d0
    assert pick_decode([d0, d1], lora="a") is d1  # 0.25 - 0.2 > -0.1
    assert pick_decode([d0, _worker("decode", 1, free=50, loras=("a",))], lora="a") is d0


async def test_kv_aware_routing_hashes_the_prompt_under_the_adapter():
    from gateway.worker_pool import WorkerPool

    asked: list[list[bytes]] = []

    class Registry:
        async def list_workers(self, role=None):
            return [WorkerInfo("decode-0", "decode", "h:0", block_size=4),
                    WorkerInfo("prefill-0", "prefill", "h:1", block_size=4),
                    WorkerInfo("prefill-1", "prefill", "h:2", block_size=4)]  # a choice

    class Prefixes:
        async def leading_hits(self, ids, hashes):
            asked.append(hashes)
            return dict.fromkeys(ids, 0)

    pool = WorkerPool(Registry(), prefixes=Prefixes())
    await pool.route(False, set(), PROMPT, "a")
    await pool.route(False, set(), PROMPT)
    assert asked == [prefix_hashes(PROMPT, 4, "a"), prefix_hashes(PROMPT, 4)]
    assert asked[0] != asked[1]


def test_status_shows_each_workers_adapters():
    from pdserve.status import render

    workers = [{"role": "decode", "address": "h:1", "num_running": 0, "num_waiting": 0,
                "num_free_blocks": 5, "num_total_blocks": 5, "lora_adapters": ["a", "b"]},
               {"role": "prefill", "address": "h:2", "num_running": 0, "num_waiting": 0,
                "num_free_blocks": 5, "num_total_blocks": 5, "lora_adapters": []}]
    lines = render(workers).splitlines()
    assert lines[0].split()[-1] == "LORAS"
    assert lines[1].split()[-1] == "a,b" and lines[2].split()[-1] == "-"


def test_lora_requests_info_has_vllms_labels_and_a_timestamp():
    stats = SchedulerStats(0, 0, 5, 5, 0.0, 0, 0, 0, running_lora_adapters=("a", "b"),
                           waiting_lora_adapters=("c",))
    (sample,) = lora_requests_info(stats, 2, "decode").samples
    assert sample.name == "pdserve:lora_requests_info"
    assert sample.labels == {"max_lora": "2", "running_lora_adapters": "a,b",
                             "waiting_lora_adapters": "c", "role": "decode"}
    assert abs(sample.value - time.time()) < 60


# ---- the gateway's LoRA logic, hosts faked -----------------------------------------------
class FakeHosts:
    def __init__(self, bad: str | None = None, busy: str | None = None) -> None:
        self.bad, self.busy, self.loaded = bad, busy, set()

    async def load(self, lora: LoRARequest) -> None:
        if lora.lora_path == self.bad:
            raise ValueError(f"adapter {lora.lora_name!r}: rank 32 > max_lora_rank 16")
        self.loaded.add(lora.lora_name)

    async def unload(self, lora: LoRARequest) -> None:
        if lora.lora_name == self.busy:
            raise LoRAInUseError(f"LoRA adapter {lora.lora_name!r} has 2 requests")
        self.loaded.discard(lora.lora_name)


async def _status(coro) -> int:
    from gateway.errors import OpenAIError

    try:
        await coro
    except OpenAIError as exc:
        return exc.status
    return 200


async def test_load_and_unload_answer_vllms_statuses():
    hosts = FakeHosts(bad="/bad", busy="busy")
    models = LoRAModels(MemoryCatalog(), hosts)
    await models.seed([LoRAModule("busy", "/b")])
    assert await models.load("a", "/a", "base") == "Success: LoRA adapter 'a' added successfully."
    assert await models.resolve("a") == LoRARequest("a", lora_int_id("a"), "/a")
    assert [await _status(models.load(n, p, "base")) for n, p in (
        ("a", "/a2"), ("base", "/x"), ("c", "/bad"), (None, "/x"), ("c", ""))] == [400] * 5
    assert await models.resolve("c") is None and "c" not in hosts.loaded
    assert await _status(models.unload("nope")) == 404
    assert await _status(models.unload("busy")) == 409
    assert await models.resolve("busy") is not None  # still served
    assert await models.unload("a") == "Success: LoRA adapter 'a' removed successfully."
    assert await models.resolve("a") is None and hosts.loaded == set()


class _RpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class ScriptedWorkers(WorkerAdapters):
    """WorkerAdapters whose rpcs answer from `script[(address, method)]` (None: OK)."""

    def __init__(self, workers: list[WorkerInfo], script: dict) -> None:
        class Pool:
            async def list(self):
                return workers

        super().__init__(Pool())  # type: ignore[arg-type]
        self.script, self.calls = script, []

    async def _call(self, worker, method, request):
        self.calls.append((worker.address, method))
        return self.script.get((worker.address, method))


async def test_a_load_failing_on_one_worker_is_rolled_back_on_the_others():
    workers = [_worker("prefill", 0), _worker("decode", 1), _worker("tokenizer", 2)]
    bad = _RpcError(grpc.StatusCode.INVALID_ARGUMENT, "rank 32 > max_lora_rank 16")
    hosts = ScriptedWorkers(workers, {("h:1", "LoadLoRA"): bad})
    with pytest.raises(ValueError, match="decode worker h:1: rank 32"):
        await hosts.load(LoRARequest("x", 1, "/x"))
    assert hosts.calls == [("h:0", "LoadLoRA"), ("h:1", "LoadLoRA"), ("h:0", "UnloadLoRA")]
    busy = _RpcError(grpc.StatusCode.FAILED_PRECONDITION, "LoRA adapter 'x': 3 requests")
    missing = _RpcError(grpc.StatusCode.NOT_FOUND, "not loaded")
    hosts = ScriptedWorkers(workers, {("h:0", "UnloadLoRA"): busy})
    with pytest.raises(LoRAInUseError, match="prefill worker h:0: LoRA adapter 'x': 3"):
        await hosts.unload(LoRARequest("x", 1, "/x"))
    assert hosts.calls[-1] == ("h:1", "LoadLoRA")  # unloaded there: loaded again
    hosts = ScriptedWorkers(workers + [_worker("decode", 3)],
                            {("h:0", "UnloadLoRA"): busy, ("h:3", "UnloadLoRA"): missing})
    with pytest.raises(LoRAInUseError):
        await hosts.unload(LoRARequest("x", 1, "/x"))
    assert hosts.calls[3:] == [("h:1", "LoadLoRA")]  # not where it was never loaded
    hosts = ScriptedWorkers(workers, {("h:0", "UnloadLoRA"): missing})
    await hosts.unload(LoRARequest("x", 1, "/x"))  # a worker not holding it is fine
    assert hosts.calls == [("h:0", "UnloadLoRA"), ("h:1", "UnloadLoRA")]


async def test_worker_lora_rpcs_map_engine_errors_to_statuses():
    from pdserve.cluster.grpc_server import NotFoundError, PreconditionError, status_for
    from pdserve.cluster.lora_service import LoRARpcs

    class Engine:
        async def remove_lora(self, name):
            if name == "busy":
                raise LoRAInUseError("LoRA adapter 'busy' has 2 requests running or waiting")
            raise KeyError(name)

        def list_loras(self):
            return [LoRARequest("a", 3, "/a")]

    rpcs = LoRARpcs()
    rpcs.engine = Engine()  # type: ignore[assignment]
    for name, error, code in (("busy", PreconditionError, "FAILED_PRECONDITION"),
                              ("gone", NotFoundError, "NOT_FOUND")):
        with pytest.raises(error) as caught:
            await rpcs.UnloadLoRA(common_pb2.UnloadLoRARequest(name=name), None)
        assert status_for(caught.value).name == code and name in str(caught.value)
    listed = await rpcs.ListLoRAs(common_pb2.ListLoRAsRequest(), None)
    assert [lora_from_pb(a) for a in listed.adapters] == [LoRARequest("a", 3, "/a")]


# ---- the colocated gateway over the real engine -----------------------------------------
@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("serving_adapters")
    return {
        "a": make_adapter(tiny_llama_dir, root / "a", rank=8, seed=1, scale=3.0),
        "b": make_adapter(tiny_llama_dir, root / "b", rank=4, targets=("q_proj", "v_proj"),
                          seed=2, scale=3.0),
        "rank32": make_adapter(tiny_llama_dir, root / "rank32", rank=32, seed=3),
    }


@pytest.fixture(scope="module")
def offline(tiny_llama_dir, adapters) -> dict[str | None, list[int]]:
    """The offline engine's greedy token ids for PROMPT: base model, then each adapter."""
    from engine.llm import LLM

    llm = LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory=8 << 20,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    out = {}
    for name in (None, "a", "b"):
        lora = None if name is None else LoRARequest(name, lora_int_id(name), adapters[name])
        (res,) = llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=lora)
        assert len(res.outputs[0].token_ids) == MAX_TOKENS
        out[name] = list(res.outputs[0].token_ids)
    assert len({tuple(ids) for ids in out.values()}) == 3  # the adapters move greedy tokens
    return out


@pytest.fixture(scope="module")
def expected(offline, bundled_tokenizer) -> dict[str | None, str]:
    """The offline greedy text for PROMPT, as the gateway detokenizes it."""
    return {name: bundled_tokenizer.decode(ids, skip_special_tokens=True)
            for name, ids in offline.items()}


@pytest.fixture(scope="module")
def colocated(tiny_llama_dir, adapters):
    from engine.async_engine import AsyncLLMEngine
    from gateway.app import build_app
    from gateway.local_backend import LocalBackend
    from gateway.lora import EngineAdapters
    from gateway.metrics import GatewayMetrics

    engine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", device="cpu",
                                      kv_cache_memory=8 << 20, enable_lora=True, max_loras=2,
                                      max_lora_rank=16)
    models = LoRAModels(MemoryCatalog(), EngineAdapters(engine))
    asyncio.run(models.seed([LoRAModule("a", adapters["a"], "tiny-base")]))
    metrics = GatewayMetrics()
    metrics.watch_engine(engine.stats, 2)
    app = build_app(LocalBackend(engine, "tiny"), api_key=KEY, metrics=metrics, loras=models)
    yield app, engine
    engine.shutdown()


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                             headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def _completion(model: str, max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


async def test_colocated_serves_adapters_by_model_name(colocated, adapters, expected):
    app, _ = colocated
    async with _client(app) as http:
        models = (await http.get("/v1/models")).json()["data"]
        assert [(m["id"], m.get("parent"), m["root"]) for m in models] == [
            ("tiny", None, "tiny"), ("a", "tiny-base", adapters["a"])]
        for model, want in (("tiny", expected[None]), ("a", expected["a"])):
            r = await http.post("/v1/completions", json=_completion(model))
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model and r.json()["choices"][0]["text"] == want
        r = await http.post("/v1/chat/completions", json={
            "model": "nope", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await http.post("/tokenize", json={"model": "a", "prompt": "hello"})
        assert r.status_code == 200 and r.json()["count"] > 0
        # loaded over HTTP, used, unloaded
        body = {"lora_name": "b", "lora_path": adapters["b"]}
        r = await http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' added successfully."
        assert (await http.post("/v1/load_lora_adapter", json=body)).status_code == 400
        r = await http.post("/v1/completions", json=_completion("b"))
        assert r.json()["choices"][0]["text"] == expected["b"]
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 200 and "removed" in r.text
        assert (await http.post("/v1/completions", json=_completion("b"))).status_code == 404
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]


async def test_colocated_refuses_bad_adapters_and_needs_the_key(colocated, adapters, tmp_path):
    app, engine = colocated
    async with _client(app) as http:
        for path, why in ((adapters["rank32"], "rank"), (str(tmp_path / "none"), "")):
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": "x",
                                                                "lora_path": path})
            assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        assert "x" not in [r.lora_name for r in engine.list_loras()]
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert r.status_code == 400 and "Both" in r.json()["error"]["message"]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as anonymous:
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = await anonymous.post(route, json={"lora_name": "a", "lora_path": "/x"})
            assert r.status_code == 401, route


async def test_colocated_unload_of_an_adapter_in_use_is_refused(colocated):
    app, engine = colocated
    async with _client(app) as http:
        # long enough to be running when the unload comes (the LoRA kernels run in Triton's
        # interpreter on the CPU: ~0.1 s a token)
        long = asyncio.create_task(http.post("/v1/completions", json=_completion("a", 48)))
        while not (await engine.stats()).running_lora_adapters:
            assert not long.done(), long.result().text
            await asyncio.sleep(0.01)
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert r.status_code == 409, r.text
        message = r.json()["error"]["message"]
        assert "'a'" in message and "1 request" in message
        text = (await http.get("/metrics")).text
        assert 'pdserve:lora_requests_info{max_lora="2",running_lora_adapters="a"' in text
        assert (await long).status_code == 200
    assert "a" in [r.lora_name for r in engine.list_loras()]


# ---- the disaggregated cluster: real processes, gRPC, Redis --------------------------------
NAMESPACE = "loraserving"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, adapters, redis_url, tmp_path_factory):
    from cluster import run_cluster

    with run_cluster(tmp_path_factory.mktemp("lora_cluster"), "--model", tiny_llama_dir,
                     "--dtype", "float32", "--kv-cache-memory", str(8 << 20),
                     "--redis-url", redis_url, "--redis-namespace", NAMESPACE,
                     "--enable-lora", "--lora-modules", f"a={adapters['a']}",
                     "--max-loras", "2", "--api-key", KEY) as c:
        yield c


@pytest.fixture(scope="module")
def openai_client(cluster):
    import openai

    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _http(cluster) -> httpx.Client:
    return httpx.Client(base_url=cluster.url, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=120)


def _workers(cluster) -> list[WorkerInfo]:
    from pdserve.cluster.registry import WorkerRegistry
    from pdserve.cluster.state import connect

    async def go() -> list[WorkerInfo]:
        client = connect(cluster.redis_url)
        try:
            workers = await WorkerRegistry(client, prefix=NAMESPACE).list_workers()
        finally:
            await client.aclose()
        return [w for w in workers if w.role in ("prefill", "decode")]

    return asyncio.run(go())


def _until(fn, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := fn()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    return value


def _complete(client, model: str) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.model == model and r.usage.completion_tokens == MAX_TOKENS
    return r.choices[0].text


def _token_texts(client, model: str) -> list[str]:
    """The greedy completion's tokens, each as its own text (the response's logprobs)."""
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    return r.choices[0].logprobs.tokens


def test_split_pipeline_serves_adapters_like_the_offline_engine(
    cluster, openai_client, expected, offline, bundled_tokenizer, adapters
):
    models = openai_client.models.list().data
    base = models[0].id
    assert [(m.id, getattr(m, "parent", None)) for m in models] == [(base, None), ("a", base)]
    assert models[1].root == adapters["a"]
    assert _complete(openai_client, "a") == expected["a"]
    assert _complete(openai_client, base) == expected[None]
    for name, model in (("a", "a"), (None, base)):  # token for token
        assert _token_texts(openai_client, model) == [
            bundled_tokenizer.decode([t], skip_special_tokens=False) for t in offline[name]]
    chat = openai_client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert chat.model == "a" and chat.choices[0].message.content is not None
    # both workers preloaded --lora-modules and publish it; their metrics page says so
    assert all(w.lora_adapters == ["a"] for w in _workers(cluster))
    decode = next(w for w in _workers(cluster) if w.role == "decode")
    page = httpx.get(f"http://{decode.metrics_address}/metrics").text
    assert 'pdserve:lora_requests_info{max_lora="2"' in page


def test_load_use_and_unload_over_http_reach_every_worker(cluster, openai_client, expected,
                                                          adapters, capsys):
    import openai
    from cluster import extra_gateway

    from pdserve import status

    with _http(cluster) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "b",
                                                     "lora_path": adapters["b"]})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' added successfully."
        assert _complete(openai_client, "b") == expected["b"]
        with extra_gateway(cluster, "--redis-namespace", NAMESPACE, "--enable-lora") as (url, _):
            # another gateway of the cluster knows the adapter from Redis and serves it
            models = httpx.get(url + "/v1/models").json()["data"]
            assert [m["id"] for m in models][1:] == ["a", "b"]
            r = httpx.post(url + "/v1/completions", json=_completion("b"), timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected["b"]
        _until(lambda: all(sorted(w.lora_adapters) == ["a", "b"] for w in _workers(cluster)))
        args = argparse.Namespace(redis_url=cluster.redis_url, redis_namespace=NAMESPACE,
                                  gateway="", json=False)
        assert status.run(args) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[0].split()[-1] == "LORAS"
        assert sorted(line.split()[-1] for line in table[1:]) == ["-", "a,b", "a,b"]
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 200 and "removed" in r.text
        _until(lambda: all(w.lora_adapters == ["a"] for w in _workers(cluster)))
        with pytest.raises(openai.NotFoundError) as gone:
            _complete(openai_client, "b")
        assert gone.value.code == "model_not_found"
        assert [m.id for m in openai_client.models.list().data][1:] == ["a"]


def test_bad_adapters_unknown_models_and_the_api_key(cluster, openai_client, adapters,
                                                     tmp_path):
    import openai

    with _http(cluster) as http:
        for path, why in ((adapters["rank32"], "rank"), (str(tmp_path / "none"), "none")):
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
            assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a",
                                                     "lora_path": adapters["a"]})
        assert r.status_code == 400 and "already been loaded" in r.text
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 404
    assert all("x" not in w.lora_adapters for w in _workers(cluster))  # rolled back
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        r = httpx.post(cluster.url + route, json={"lora_name": "x", "lora_path": "/x"})
        assert r.status_code == 401, route
    with pytest.raises(openai.NotFoundError):
        _complete(openai_client, "nope")


def test_an_adapter_failing_to_load_on_the_workers_leaves_no_kv(cluster, openai_client,
                                                                tmp_path):
    """An adapter the catalog names but the workers cannot read (e.g. its volume missing
    there): 400 with the engine's message, and no worker keeps a block of the request."""
    import openai

    from pdserve.cluster.lora_catalog import RedisCatalog
    from pdserve.cluster.state import connect

    async def record() -> None:
        client = connect(cluster.redis_url)
        try:
            await RedisCatalog(client, prefix=NAMESPACE).add(
                LoRAModule("ghost", str(tmp_path / "missing")))
        finally:
            await client.aclose()

    asyncio.run(record())
    with pytest.raises(openai.BadRequestError, match="ghost"):
        _complete(openai_client, "ghost")
    with _http(cluster) as http:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "ghost"}).status_code \
            == 200
    _until(lambda: all(w.num_free_blocks == w.num_total_blocks and not w.num_running
                       for w in _workers(cluster)))


def test_unload_while_a_request_of_the_adapter_runs_is_refused(cluster, openai_client):
    finish: list[str | None] = []
    usage: list[int] = []
    first = threading.Event()

    def run() -> None:  # long enough to be running when the unload comes (~0.1 s a token)
        stream = openai_client.completions.create(
            model="a", prompt=PROMPT, max_tokens=64, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.usage is not None:
                usage.append(chunk.usage.completion_tokens)
            if chunk.choices:
                finish.append(chunk.choices[0].finish_reason)
                first.set()

    reader = threading.Thread(target=run)
    reader.start()
    assert first.wait(60)
    with _http(cluster) as http:
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    reader.join(120)
    assert r.status_code == 409, r.text
    message = r.json()["error"]["message"]
    assert "'a'" in message and "1 request" in message
    assert finish[-1] == "length" and usage == [64]  # the request ran on to its end
    assert [m.id for m in openai_client.models.list().data][1:] == ["a"]
