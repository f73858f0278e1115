"""kvrelay's model executor: `LLM` (offline API) and `SamplingParams`.

Heavy modules load on first use, so `import engine.block_pool` stays torch-free.
"""


def __getattr__(name):
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from engine.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]
