"""Weight sync: the transports that carry the actor's HF-named buckets (`weights.gather`) to the
rollout engines after every optimizer step, one per placement and engine kind."""
