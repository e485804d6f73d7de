from tessera.sampling.params import SamplingParams, SamplingParamsError
from tessera.sampling.sampler import Sampler, SamplingBatch

__all__ = ["Sampler", "SamplingBatch", "SamplingParams", "SamplingParamsError"]
