"""LoRA: the published layout (plain base names + lora_A / scaled lora_B) and its merge give the
engine exactly the function the trainer's `peft` model computes; resuming the wrong kind of
checkpoint fails with a clear error instead of silently loading half a model."""

from __future__ import annotations

import pytest
import torch

from decentrl.config import LoraConfig, ModelConfig
from decentrl.model import lora
from decentrl.model.tiny import build_tiny
from decentrl.trainer.checkpoint import Checkpointer, TrainerState
from decentrl.weights.codec import published_state


def plain_logits(state: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    model, _ = build_tiny(ModelConfig(seed=7))  # other random weights: all must be overwritten
    missing, unexpected = model.load_state_dict(lora.merge(state), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # the head is tied to the embedding
    return model(input_ids=ids).logits


def test_published_layout_names_base_and_adapters(adapted) -> None:
    state = lora.publication_state(adapted)
    modules = lora.adapted_modules(state)
    assert len(modules) == 2 * 7  # q k v o gate up down in each of the 2 layers; not the head
    assert "model.layers.0.self_attn.q_proj.weight" in state
    assert state["model.layers.0.self_attn.q_proj.lora_A"].shape == (2, 128)
    assert state["model.layers.0.mlp.down_proj.lora_B"].shape == (128, 2)
    assert not any("base_layer" in name or name.startswith("base_model") for name in state)
    # the scaling alpha / rank = 4 is folded into B
    module = adapted.base_model.model.model.layers[0].self_attn.q_proj
    torch.testing.assert_close(
        state["model.layers.0.self_attn.q_proj.lora_B"], 4 * module.lora_B["default"].weight
    )


def test_merged_state_computes_what_the_peft_model_computes(adapted) -> None:
    ids = torch.randint(3, 98, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = adapted(input_ids=ids).logits
        exact = plain_logits(lora.publication_state(adapted), ids)
        bf16 = plain_logits(published_state(lora.publication_state(adapted), "bfloat16"), ids)
        unmerged = plain_logits(
            {k: v for k, v in lora.publication_state(adapted).items() if ".lora_" not in k}, ids
        )
    torch.testing.assert_close(exact, expected, atol=1e-5, rtol=1e-5)
    assert (bf16 - expected).abs().max() < 0.05  # bf16 rounding only
    assert (unmerged - expected).abs().max() > 0.05  # the adapters matter: the check has teeth


def test_merge_of_changed_names_returns_only_the_layers_they_touch(adapted) -> None:
    state = lora.publication_state(adapted)
    touched = lora.merge(state, ["model.layers.1.mlp.up_proj.lora_B", "model.norm.weight"])
    assert set(touched) == {"model.layers.1.mlp.up_proj.weight", "model.norm.weight"}
    full = lora.merge(state)
    torch.testing.assert_close(
        touched["model.layers.1.mlp.up_proj.weight"], full["model.layers.1.mlp.up_proj.weight"]
    )
    plain_state = {k: v for k, v in state.items() if ".lora_" not in k}
    assert lora.merge(plain_state) == plain_state  # no adapters: unchanged


def test_an_adapter_without_its_partner_or_of_the_wrong_shape_is_refused(adapted) -> None:
    state = lora.publication_state(adapted)
    del state["model.layers.0.self_attn.k_proj.lora_B"]
    with pytest.raises(ValueError, match=r"k_proj.lora_A without its lora_B"):
        lora.merge(state)
    state = lora.publication_state(adapted)
    state["model.layers.0.mlp.down_proj.lora_B"] = state["model.layers.0.mlp.down_proj.lora_B"].t()
    with pytest.raises(ValueError, match=r"down_proj: lora_B \[2, 128\] @ lora_A \[2, 512\] does not fit"):
        lora.merge(state)


def test_resuming_a_lora_checkpoint_into_a_full_model_fails_clearly(adapted, tmp_path) -> None:
    checkpointer = Checkpointer(tmp_path / "trainer")
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad])
    checkpointer.save(adapted, optimizer, TrainerState(policy_version=3, batch_id=None))
    resumed = lora.attach(build_tiny(ModelConfig())[0], LoraConfig(rank=2, alpha=8.0))
    state = checkpointer.load(
        resumed, torch.optim.AdamW([p for p in resumed.parameters() if p.requires_grad])
    )
    assert state.policy_version == 3
    for name, tensor in resumed.state_dict().items():
        torch.testing.assert_close(tensor, adapted.state_dict()[name], msg=name)
    full = build_tiny(ModelConfig())[0]
    with pytest.raises(ValueError, match="does not fit the model.*lora"):
        checkpointer.load(full, torch.optim.AdamW(full.parameters()))


def test_the_kl_reference_of_a_lora_run_is_the_base_under_the_adapters() -> None:
    base, _ = build_tiny(ModelConfig())
    ids = torch.randint(3, 98, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = base(input_ids=ids).logits.clone()
    peft_model = lora.attach(base, LoraConfig(rank=2))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.fill_(0.1)
    reference = lora.reference_model(peft_model, load_warm_start=lambda: pytest.fail("no second copy"))
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
        torch.testing.assert_close(reference(input_ids=ids).logits, expected)
        torch.testing.assert_close(peft_model(input_ids=ids).logits, adapted)  # adapters back on
    assert (adapted - expected).abs().max() > 0.1
    frozen = [p.requires_grad for n, p in reference.named_parameters() if "lora_" not in n]
    assert frozen and not any(frozen)  # the base never trains
