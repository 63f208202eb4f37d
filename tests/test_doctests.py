"""The `>>>` examples in the kernel, cache and generation modules' docstrings run and print what they say."""

import doctest
import importlib

import pytest

MODULES = ["kvlib._triton", "kvlib.attention", "kvlib.vector_add", "kvlib.cache", "kvlib.paged", "kvlib.quant",
           "kvlib.gqa", "kvlib.ragged", "kvlib.generate", "kvlib.model", "kvlib.engine", "kvlib.evict", "kvlib.lowbit",
           "kvlib.kivi", "kvlib.footprint", "kvlib.compress", "kvlib.serve", "kvlib.sparse", "kvlib.hybrid",
           "kvlib.speculate", "kvlib.dist.tp", "kvlib.dist.cp", "kvlib.dist.router"]

# Every public name of these modules that must carry an example (kvlib.model: the loader and the forward pass).
MUST_HAVE_EXAMPLES = {
    "kvlib.attention": ["attention_ref", "flash_attention", "check_attention_inputs"],
    "kvlib.vector_add": ["add", "add_ref"],
    "kvlib.cache": ["KVCache", "KVCache.truncate", "store_kv", "store_kv_ref", "decode_attention",
                    "decode_attention_ref"],
    "kvlib.paged": ["BlockAllocator", "PagedKVCache", "paged_decode_attention", "paged_decode_attention_ref",
                    "store_paged", "store_paged_ref"],
    "kvlib.quant": ["quantize_int8", "dequantize_int8", "int8_decode_attention", "int8_decode_attention_ref",
                    "store_kv_int8", "store_kv_int8_ref", "Int8KVCache"],
    "kvlib.gqa": ["repeat_kv", "grouped_decode_attention", "grouped_decode_attention_ref", "mha_to_gqa"],
    "kvlib.ragged": ["ragged_paged_attention", "ragged_paged_attention_ref"],
    "kvlib.generate": ["generate_naive", "generate", "pad_prompts", "sample_next"],
    "kvlib.model": ["load_hf", "Transformer.forward"],
    "kvlib._triton": ["check_kernel_dtype"],
    "kvlib.engine": ["Engine"],
    "kvlib.evict": ["keep_highest", "window_votes", "sink_window_priority", "h2o_accumulate", "index_decode_attention",
                    "index_decode_attention_ref", "SlidingWindowCache", "SinkCache", "H2OCache", "SnapKVCache",
                    "PagedWindowCache", "pool_votes", "snapkv_select", "pyramid_budgets", "PyramidKVCache",
                    "KnormCache", "TOVACache", "ExpectedAttentionCache"],
    "kvlib.lowbit": ["quantize_asym", "dequantize_asym", "pack_bits", "unpack_bits", "pack_2bit", "unpack_2bit",
                     "quantize_keys_per_channel", "quantize_values_per_token", "LayerQuantCache", "kl_divergence",
                     "layer_sensitivity", "plan_bits"],
    "kvlib.kivi": ["kivi_decode_attention", "kivi_decode_attention_ref", "KiviCache", "KiviCache.truncate",
                   "KiviCache.enable_rollback", "SnapKiviCache"],
    "kvlib.footprint": ["held_bytes", "MemoryMeter"],
    "kvlib.serve": ["TextStream", "ServeMetrics"],
    "kvlib.sparse": ["block_summaries", "update_block_summaries", "block_upper_bound", "select_blocks",
                     "sparse_decode_attention", "sparse_decode_attention_ref", "QuestCache", "QuestCache.truncate"],
    "kvlib.speculate": ["prompt_lookup", "PromptLookupDrafter", "LayerSkipDrafter", "greedy_accept",
                        "speculative_accept", "speculative_generate", "SpeculativeResult", "truncate_cache",
                        "KiviVerifySeam"],
    "kvlib.hybrid": ["layer_plan", "band_mask", "banded_attention_ref", "HybridCache", "HybridCache.truncate",
                     "hybrid_bytes", "blocks_held", "pool_blocks", "aligned_block_size", "prefix_hit",
                     "state_hybrid_bytes"],
    "kvlib.compress": ["record_kv", "fit_low_rank", "low_rank_error", "LowRankKVCache", "MLAConfig",
                       "LatentAttention", "LatentKVCache", "mla_bytes_per_token", "mha_bytes_per_token",
                       "mla_gqa_groups", "SharedKVSeam", "CrossLayerKVCache", "finetune_shared", "evaluate_shared"],
}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples failed in {name} (see above)"


@pytest.mark.parametrize("name", sorted(MUST_HAVE_EXAMPLES))
def test_public_names_have_examples(name):
    module = importlib.import_module(name)
    missing = []
    for attr in MUST_HAVE_EXAMPLES[name]:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
        if ">>>" not in (obj.__doc__ or ""):
            missing.append(attr)
    assert not missing, f"{name}: no >>> example in the docstring of {missing}"
