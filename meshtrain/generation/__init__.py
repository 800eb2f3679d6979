"""Generation on the training plan: KV cache, prefill and decode steps, sampling, prompt
log-probabilities, int8 weights (:mod:`.engine` says how padding, stops and MoE routing work)."""

from meshtrain.generation.api import Loaded, generate, load
from meshtrain.generation.cache import KVCache, cache_bytes_per_device, cache_shardings, empty_cache
from meshtrain.generation.engine import Engine, Generation, Output, Timing, generation_config
from meshtrain.generation.loop import DecodeLoop
from meshtrain.generation.runs import FALLBACK_RECIPE, RunInfo, generation_recipe, params_plan, read_run
from meshtrain.generation.sampling import Sampling, choose, token_logprobs
from meshtrain.generation.tokenizer import ByteTokenizer
from meshtrain.generation.weights import (Int8Weight, WeightFormat, WeightMemory, store_weights,
                                          weight_bytes_per_device)

__all__ = ["ByteTokenizer", "DecodeLoop", "Engine", "FALLBACK_RECIPE", "Generation", "Int8Weight", "KVCache", "Loaded", "Output",
           "RunInfo", "Sampling", "Timing", "WeightFormat", "WeightMemory", "cache_bytes_per_device",
           "cache_shardings", "choose", "empty_cache", "generate", "generation_config", "generation_recipe", "load",
           "params_plan", "read_run", "store_weights", "token_logprobs", "weight_bytes_per_device"]
