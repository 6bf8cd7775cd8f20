"""pdserve's shared core: the one engine (model, paged KV cache, scheduler, sampler) that the
monolithic engine, the prefill worker and the decode worker all run; the channels and KV
transports between processes; and the `pdserve` command line (common/cli.py), whose commands
reach into router/ and bench/."""
