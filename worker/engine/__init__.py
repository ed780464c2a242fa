"""The task engine: queue, claim, batch, budget, execution, retry, rate limits and progress."""
