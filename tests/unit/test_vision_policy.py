"""A vision-language policy (the tiny LLaVA) through the engine, the trainer and the verifier.

The engine samples from image + text prompts with its KV cache; the trainer's `sequence_logprobs`
and the verifier's recompute score the same tokens with the same pixels; all three agree within
the text path's tolerance (1e-5, `test_algo_logprobs.py`). The images matter (other pixels move
the log-probs), image tokens never enter the loss, the engine never samples one, and LoRA adapts
the language model unless asked to adapt the vision tower too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decentrl.algo.logprobs import sequence_logprobs
from decentrl.algo.registry import build_advantage
from decentrl.config import LoraConfig, ModelConfig
from decentrl.config.algorithm import AlgorithmConfig
from decentrl.config.run import VisionTowerConfig
from decentrl.engines.hf import HFEngine
from decentrl.envs import load_environment
from decentrl.envs.chat import ChatFormat
from decentrl.envs.episode import Episode, run_episodes, start
from decentrl.model import lora
from decentrl.model.special import read_eos_token_ids
from decentrl.model.tiny import save_model_dir
from decentrl.model.tiny_vlm import build_tiny_vlm
from decentrl.model.vision import PixelInputs
from decentrl.protocol import RolloutImage, SamplingParams, TrainGroup, TrainRollout, VerifyJob
from decentrl.trainer.batch import collate
from decentrl.verifier.recompute import Measurement, measure

CONFIG = ModelConfig(hidden_size=64, num_heads=2, intermediate_size=128, vision=VisionTowerConfig())


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory):
    model, processor = build_tiny_vlm(CONFIG)
    model_dir = save_model_dir(model, processor, tmp_path_factory.mktemp("vlm"))
    engine = HFEngine.from_model_dir(model_dir, device="cpu")
    engine.load_weights(model.state_dict(), version=3)
    chat = ChatFormat.from_model_dir(model_dir, read_eos_token_ids(model_dir))
    return engine, chat, model_dir


def played(vlm, temperature: float, count: int = 6) -> list[Episode]:
    engine, chat, _ = vlm
    env = load_environment("count_shapes")
    episodes = [start(env, chat, env.problem(seed, "train")) for seed in range(count)]
    run_episodes(
        engine, env, chat, episodes, SamplingParams(temperature=temperature, max_new_tokens=5), seed=7
    )
    return episodes


def right_padded(episodes: list[Episode]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [episode.token_ids for episode in episodes]
    ids = torch.zeros((len(rows), max(map(len, rows))), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):
        ids[index, : len(row)], mask[index, : len(row)] = torch.tensor(row), 1
    return ids, mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_trainer_and_verifier_agree_on_a_vlm_rollout(vlm, temperature: float) -> None:
    engine, _, model_dir = vlm
    episodes = played(vlm, temperature)
    pixels = PixelInputs.from_model_dir(model_dir)
    assert pixels is not None
    vision = pixels.vision_inputs([episode.images for episode in episodes])
    ids, mask = right_padded(episodes)
    with torch.no_grad():
        trainer_bt, _ = sequence_logprobs(engine.model, ids, mask, temperature, vision=vision)
    jobs = []
    for row, episode in enumerate(episodes):
        segment = episode.segments[0]
        start_at = len(episode.prompt_ids)
        trainer_side = trainer_bt[row, start_at : start_at + len(segment.token_ids)]
        # the text path's tolerance (test_algo_logprobs.py)
        torch.testing.assert_close(trainer_side, torch.tensor(segment.logprobs), atol=1e-5, rtol=0)
        jobs.append(
            VerifyJob(
                rollout_id=f"r{row}",
                temperature=temperature,
                prompt_token_ids=episode.prompt_ids,
                segments=episode.segments,
                pit_seed=row,
                images=[RolloutImage(sha256=image.sha256) for image in episode.images],
                seed=episode.problem.seed,
            )
        )
    results: dict[str, Measurement] = {}
    assert measure(engine.model, jobs, 3, results, vision) is not None
    assert len(results) == len(jobs)
    for found in results.values():
        assert found.logprob_tokens > 0 and found.max_logprob_error <= 1e-5


def test_the_images_change_the_logprobs(vlm) -> None:
    """Scored with other pixels, the same tokens get other log-probs: the images are inputs."""
    engine, _, model_dir = vlm
    episodes = played(vlm, 1.0)
    pixels = PixelInputs.from_model_dir(model_dir)
    assert pixels is not None
    vision = pixels.vision_inputs([episode.images for episode in episodes])
    assert vision is not None
    ids, mask = right_padded(episodes)
    with torch.no_grad():
        seen, _ = sequence_logprobs(engine.model, ids, mask, 1.0, vision=vision)
        blind, _ = sequence_logprobs(
            engine.model, ids, mask, 1.0, vision={"pixel_values": vision["pixel_values"].flip(0)}
        )
    assert float((seen - blind).abs().max()) > 1e-3


def test_the_engine_never_samples_an_image_token(vlm) -> None:
    engine, chat, _ = vlm
    assert chat.image_tokens is not None
    image_token = chat.image_tokens.token_id
    with torch.no_grad():  # make the image token the model's favourite
        engine.model.lm_head.weight[image_token] *= 0  # tied: also its input embedding, never read
        engine.model.lm_head.weight[image_token] += 50 * engine.model.model.language_model.norm.weight
    try:
        episodes = played(vlm, 1.0) + played(vlm, 0.0)
        assert all(image_token not in episode.segments[0].token_ids for episode in episodes)
        suppressed, engine.suppressed_ids = engine.suppressed_ids, []
        try:  # the control: unsuppressed, this model samples it
            assert any(image_token in episode.segments[0].token_ids for episode in played(vlm, 0.0))
        finally:
            engine.suppressed_ids = suppressed
    finally:
        state = build_tiny_vlm(CONFIG)[0].state_dict()
        engine.load_weights(state, version=3)


def test_image_tokens_are_masked_out_of_the_loss_and_rows_keep_their_pixels(vlm) -> None:
    _, chat, model_dir = vlm
    episodes = played(vlm, 1.0, count=4)
    pixels = PixelInputs.from_model_dir(model_dir)
    assert pixels is not None and chat.image_tokens is not None
    group = TrainGroup(
        group_id="g",
        task_id="t",
        seed=0,
        rollouts=[
            TrainRollout(
                rollout_id=f"r{index}",
                worker_id="w",
                prompt_token_ids=episode.prompt_ids,
                segments=episode.segments,
                finish_reason="length",
                reward=float(index % 2),
            )
            for index, episode in enumerate(episodes)
        ],
    )
    rows = [pixels.pixel_values(episode.images) for episode in episodes]
    batch = collate([group], 0, build_advantage(AlgorithmConfig().advantage), pixel_rows=rows)
    image_positions = batch.input_ids_bt == chat.image_tokens.token_id
    assert int(image_positions.sum()) == 4 * chat.image_tokens.per_image
    assert not bool(batch.loss_mask_bt[image_positions].any())
    picked = batch.select([2, 0])
    vision = picked.vision()
    assert vision is not None
    torch.testing.assert_close(vision["pixel_values"], torch.cat([rows[2], rows[0]]))


def vlm_batch(vlm):
    """Two groups of four sampled VLM rollouts, rewarded 1/0 alternately, as the trainer collates them."""
    _, _, model_dir = vlm
    episodes = played(vlm, 1.0, count=8)
    pixels = PixelInputs.from_model_dir(model_dir)
    assert pixels is not None
    groups = [
        TrainGroup(
            group_id=f"g{g}",
            task_id=f"t{g}",
            seed=g,
            rollouts=[
                TrainRollout(
                    rollout_id=f"r{g}{index}",
                    worker_id="w",
                    prompt_token_ids=episode.prompt_ids,
                    segments=episode.segments,
                    finish_reason="length",
                    reward=float(index % 2),
                )
                for index, episode in enumerate(episodes[4 * g : 4 * g + 4])
            ],
        )
        for g in range(2)
    ]
    rows = [pixels.pixel_values(episode.images) for episode in episodes]
    return collate(groups, 0, build_advantage(AlgorithmConfig().advantage), pixel_rows=rows)


@pytest.mark.parametrize("rank", [0, 2])
def test_a_training_step_moves_what_trains_and_the_delta_carries_it(vlm, rank: int) -> None:
    """Full-parameter training moves the vision tower too; LoRA moves only the language model's
    adapters. The published delta carries exactly the tensors that changed."""
    from decentrl.config import TrainerConfig
    from decentrl.model.vision import load_policy
    from decentrl.trainer.step import Algorithm, train_step
    from decentrl.weights.codec import decode_state, encode_state, published_state

    _, _, model_dir = vlm
    model = lora.attach(load_policy(model_dir, torch.float32), LoraConfig(rank=rank))
    if rank:  # adapters start at B = 0, so a first step moves only B; start them moved
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.05)
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    before = published_state(lora.publication_state(model), "float32")
    before = {name: tensor.clone() for name, tensor in before.items()}
    config = TrainerConfig(minibatches_per_version=1)
    metrics = train_step(
        model, optimizer, vlm_batch(vlm), Algorithm.from_config(AlgorithmConfig()), config, 1.0, 0, 5
    )
    assert metrics["num_loss_tokens"] > 0
    after = published_state(lora.publication_state(model), "float32")
    entries, payload = encode_state(before, after)
    changed = decode_state(entries, payload, {name: tensor.clone() for name, tensor in before.items()})
    assert set(changed) == {name for name in after if not torch.equal(before[name], after[name])}
    if rank == 0:
        assert any(name.startswith("model.vision_tower.") for name in changed)
        assert any(name.startswith("model.multi_modal_projector.") for name in changed)
    else:
        assert changed and all(
            name.startswith("model.language_model.") and ".lora_" in name for name in changed
        )


def test_lora_adapts_the_language_model_and_the_vision_tower_on_request(tmp_path: Path) -> None:
    model, _ = build_tiny_vlm(CONFIG)
    language_only = lora.target_modules(model, LoraConfig(rank=2))
    assert language_only and all(name.startswith("model.language_model.") for name in language_only)
    everything = lora.target_modules(model, LoraConfig(rank=2, vision_tower=True))
    assert any(name.startswith("model.vision_tower.") for name in everything)
    assert any(name.startswith("model.multi_modal_projector.") for name in everything)
    assert "lm_head" not in everything
    adapted = lora.attach(model, LoraConfig(rank=2))
    trainable = [name for name, parameter in adapted.named_parameters() if parameter.requires_grad]
    assert trainable and all(".language_model." in name and "lora_" in name for name in trainable)
    published = lora.publication_state(adapted)
    assert any(name.endswith(".lora_A") and name.startswith("model.language_model.") for name in published)


@pytest.mark.parametrize("train_tower", [False, True], ids=["tower-frozen", "tower-trained"])
def test_the_warm_start_keeps_the_vision_tower_unless_asked(train_tower: bool) -> None:
    """LLaVA's recipe: the warm start trains the projector and the language model, the vision
    encoder stays as built (`sft.train_vision_tower` trains it too); RL may train it afterwards."""
    from decentrl.config import SFTConfig, TaskConfig
    from decentrl.model.warmstart import train_sft, vision_tower_parameters

    task = TaskConfig(env="shape_color", args={"grid": 2, "cell": 8})
    sft = SFTConfig(steps=2, batch_size=4, teacher_misread=0.5, train_vision_tower=train_tower)
    built, _ = build_tiny_vlm(CONFIG)  # the same seed: the weights train_sft starts from
    trained, _ = train_sft(CONFIG, task, sft, show_progress=False)
    before = dict(built.named_parameters())
    after = dict(trained.named_parameters())
    tower = {id(parameter) for parameter in vision_tower_parameters(trained)}
    moved = {name for name, parameter in after.items() if not torch.equal(parameter, before[name])}
    tower_names = {name for name, parameter in after.items() if id(parameter) in tower}
    assert tower_names and moved - tower_names, "the projector and the language model train"
    assert bool(moved & tower_names) == train_tower
    assert all(parameter.requires_grad for parameter in trained.parameters())  # RL decides what trains
