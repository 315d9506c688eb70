"""`openglm doctor`: the write-ups' troubleshooting as checks, each finding with its fix.

    openglm doctor                    # this machine: torch, ISA/AMX, native kernels, threads, memory
    openglm doctor CHECKPOINT         # + what serve would refuse, template/tokenizer agreement, weights vs memory
    openglm doctor RUN                # + the run's telemetry: expert load, dead experts, loss spikes, gradients
    openglm doctor --url URL          # a running serve / agent-server: health, KV, queue, store, memory growth

Modules: `report` (Check, Report), one per target: `machine`, `checkpoint`, `run`, `server`; `diagnose` picks them.
"""
