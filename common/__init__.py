"""pdserve's shared core: the one engine (model, paged KV cache, scheduler, sampler) that the
monolithic engine, the prefill worker and the decode worker all run."""
