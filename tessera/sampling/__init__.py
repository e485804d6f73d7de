from tessera.sampling.params import SamplingParams, SamplingParamsError
from tessera.sampling.sampler import Sampler, SamplerOutput, SamplingBatch, TokenLogprobs

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "SamplingParams", "SamplingParamsError",
           "TokenLogprobs"]
