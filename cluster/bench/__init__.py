"""`kvrelay bench`: a serving benchmark for kvrelay (gRPC) or any OpenAI-compatible server.

    workload  request specs and arrival times (seeded)
    clients   gRPC and OpenAI-HTTP senders that fill in request records
    runner    warmup, then one capped run per request rate
    stats     pure statistics: percentiles, TPOT, goodput, SLO attainment
    report    results.json, stdout tables, markdown comparison of two runs
    plots     latency CDFs and rate sweeps as PNG (matplotlib, imported lazily)
    cli       the argparse subcommand
"""
