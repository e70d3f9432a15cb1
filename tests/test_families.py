"""More architectures: greedy spec and ar equal the target alone on tiny random models.

Where an architecture has sliding-window layers, the window (12) is far shorter than the rows.
"""

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from batchspec.decoding import DecodeConfig, decode_batch
from batchspec.models import load_pair
from batchspec.tiny import build_tokenizer, perturbed

from test_greedy import LENGTHS, random_prompts, reference

FAMILIES = [  # sliding windows: mixtral, gemma3_text, phi3, cohere2, starcoder2, gpt_oss, ministral, olmo3, exaone4
    "mixtral", "gemma", "gemma3_text", "phi", "phi3", "qwen2_moe", "qwen3", "qwen3_moe", "cohere", "cohere2",
    "starcoder2", "olmo2", "olmo3", "olmoe", "exaone4", "gpt_neox", "falcon", "bloom", "opt", "gpt_oss", "gptj",
    "codegen", "gpt_bigcode", "ministral", "smollm3", "granite", "granitemoe", "stablelm", "persimmon", "helium",
    "glm", "nemotron", "xglm", "biogpt",
]
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 1024, "initializer_range": 0.2}
WHERE_THERE = {  # set only on configs that have the attribute (not a computed property)
    "head_dim": 16, "rotary_dim": 8, "moe_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4,
    "num_experts_per_tok": 2, "sliding_window": 12, "tie_word_embeddings": False,
}
MAX_NEW = 24


def save_pair(folder, family: str) -> tuple[str, str]:
    tokenizer = build_tokenizer()
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), bos_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SHAPE)
    for name, value in WHERE_THERE.items():
        if name in vars(config):
            setattr(config, name, value)
    target = AutoModelForCausalLM.from_config(config)
    paths = []
    for name, model in (("target", target), ("draft", perturbed(target, 0.05, seed=1))):
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
        paths.append(str(folder / name))
    return paths[0], paths[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_and_ar_equal_target_alone(family, tmp_path):
    pair = load_pair(*save_pair(tmp_path, family), dtype="float32", device="cpu")
    prompts = random_prompts(len(pair.tokenizer), LENGTHS[:9])
    expected = [reference(pair.target, p, pair.eos_token_ids, MAX_NEW) for p in prompts]
    config = DecodeConfig(max_new_tokens=MAX_NEW, eos_token_ids=pair.eos_token_ids, gamma=4)
    for draft in (pair.draft, None):
        out = decode_batch(pair.target, draft, prompts, list(range(len(prompts))), config)
        assert [r.token_ids for r in out.rows] == expected
