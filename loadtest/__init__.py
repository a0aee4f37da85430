"""Load generator for any OpenAI-compatible endpoint: arrival patterns, TTFT/TPOT/ITL
percentiles, throughput and goodput. `python -m loadtest --help`, or `pdserve bench serve`.

  workloads.py  what is sent (random exact-length prompts, shared prefixes, ShareGPT, synthetic)
  tokens.py     exact-length prompts over a tokenizer's word tokens
  arrivals.py   when it is sent (Poisson with gamma burstiness, constant, all at once)
  client.py     the streaming httpx client, one connection pool, one timeline per request
  record.py     a request's timeline
  runner.py     warm-up, concurrency limit, a sweep over request rates, time bounds
  scrape.py     the server's own Prometheus counters around each run (--metrics-url)
  metrics.py    TTFT, TPOT, ITL, E2E, throughput, goodput: pure functions of timelines
  report.py     console tables, JSON, markdown; plots.py: PNG pictures (matplotlib)
  cli.py        the command line; compare.py: several reports side by side
"""
