"""Weights per pipeline stage: a staged publication lays its chunks out by stage, and each stage's
holder fetches exactly its section's chunks, decodes only its tensors and verifies them by its
stage's hashes, through snapshot, delta and patch, bit for bit; a forged chunk, a wrong stage hash
or another stage map is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from decentrl.config import ConfigError, WeightsConfig
from decentrl.coordinator.weights.versions import WeightStore
from decentrl.stage_map import StageMap
from decentrl.weights import sync as sync_module
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.codec import published_state, state_hash
from decentrl.weights.manifest import Manifest, check_layout, signed_bytes
from decentrl.weights.planner import NoRoute, index_entry, plan
from decentrl.weights.publisher import Publisher, Staging, _manifest, build_manifest, stage_hashes
from decentrl.weights.sections import part, tensor_groups
from decentrl.weights.signing import BadSignature, parse_public_key, sign, verify
from decentrl.weights.sync import VerificationFailed, WeightSync
from decentrl.weights.transfer import ChunkFetcher
from decentrl.weights.unique_storage import state_for_publication

LAYERS = 4
MODELS = {
    "qwen2-tied": (Qwen2Config, Qwen2ForCausalLM, True),
    "qwen2-untied": (Qwen2Config, Qwen2ForCausalLM, False),
    "llama-untied": (LlamaConfig, LlamaForCausalLM, False),
    "llama-tied": (LlamaConfig, LlamaForCausalLM, True),
}


def small_state(kind: str) -> tuple[dict[str, torch.Tensor], dict]:
    """A real architecture's parameter names at toy size, as published (bf16, tied head once)."""
    config_class, model_class, tied = MODELS[kind]
    config = config_class(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = model_class(config)
    return published_state(state_for_publication(model), "bfloat16"), config.to_dict()


def moved(state: dict[str, torch.Tensor], seed: int, fraction: float = 0.02, only: str = "") -> dict:
    """The next version: `fraction` of the elements of every tensor whose name contains `only` move."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state.items():
        tensor = tensor.clone()
        if only in name:
            mask = torch.rand(tensor.shape, generator=generator) < fraction
            tensor += (0.05 * torch.randn(tensor.shape, generator=generator) * mask).to(tensor.dtype)
        out[name] = tensor
    return out


class Memory:
    """The coordinator's weight routes in memory, counting the chunks each fetch asks for."""

    def __init__(self) -> None:
        self.chunks: dict[str, bytes] = {}
        self.manifests: dict[tuple, bytes] = {}
        self.requested: list[str] = []
        self.hidden: set[tuple] = set()
        """Manifests left out of the index (to force a route)."""
        self.forged: set[str] = set()
        """Chunks served with one byte flipped."""

    def register_trainer_key(self, key: object) -> None:
        pass

    def upload_chunk(self, digest: str, data: bytes | memoryview) -> None:
        self.chunks[digest] = bytes(data)

    def upload_manifest(
        self, version: int, kind: str, body: bytes, anchor: int | None = None, stage: int | None = None
    ) -> None:
        self.manifests[(version, kind, anchor) if stage is None else (version, kind, anchor, stage)] = body

    def manifest(self, version: int, kind: str, anchor: int | None = None) -> Manifest:
        return Manifest.model_validate_json(self.manifests[(version, kind, anchor)])

    def weights_index(self) -> list:
        return [
            index_entry(Manifest.model_validate_json(body))
            for key, body in sorted(self.manifests.items(), key=lambda item: str(item[0]))
            if key not in self.hidden
        ]

    def manifest_bytes(
        self, version: int, kind: str, anchor: int | None = None, stage: int | None = None
    ) -> bytes:
        return self.manifests[(version, kind, anchor) if stage is None else (version, kind, anchor, stage)]

    def chunk(self, digest: str) -> bytes:
        self.requested.append(digest)
        data = self.chunks[digest]
        return bytes([data[0] ^ 1]) + data[1:] if digest in self.forged else data

    def request_snapshot(self) -> dict:
        return {"pending": False}

    def peers(self) -> list:
        return []


def publisher_for(
    memory: Memory, stage_map: StageMap | None, tmp_path: Path, patches: bool = True
) -> Publisher:
    config = WeightsConfig(chunk_bytes=1024, snapshot_every=100, patch_max_fraction=0.9 if patches else 0.0)
    return Publisher(memory, config, tmp_path / "key.pem", stage_map)  # type: ignore[arg-type]


def holder(memory: Memory, publisher: Publisher, root: Path, stage: int | None, stage_map: StageMap | None):
    fetcher = ChunkFetcher(memory, ChunkStore(root, durable=False), seed=0)  # type: ignore[arg-type]
    key = parse_public_key(publisher.public_key)
    return WeightSync(memory, key, fetcher, stage=stage, stage_map=stage_map)  # type: ignore[arg-type]


def section_digests(memory: Memory, steps: list[tuple[int, str, int | None]], stage: int) -> set[str]:
    return {chunk.sha256 for step in steps for chunk in part(memory.manifest(*step), stage).chunks}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a
    )


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("num_stages", [2, 3])
def test_a_staged_publication_cuts_chunks_at_stage_groups(kind: str, num_stages: int, tmp_path: Path) -> None:
    state, config = small_state(kind)
    stage_map = StageMap.for_model(num_stages, None, config)
    assert stage_map is not None and stage_map.tied_embeddings == ("lm_head.weight" not in state)
    staging = Staging(stage_map, stage_hashes(state, stage_map) or [])
    manifest, pieces = build_manifest(0, None, state, "bfloat16", 1024, state_hash(state), staging=staging)
    assert check_layout(manifest) is None and manifest.stages is not None
    unstaged, _ = build_manifest(0, None, state, "bfloat16", 1024, state_hash(state))
    assert manifest.state_sha256 == unstaged.state_sha256  # full-model consumers see the same state
    groups = tensor_groups(stage_map, list(state))
    if stage_map.tied_embeddings:  # the tied matrix is a group of its own, held by both ends
        assert ["model.embed_tokens.weight"] in groups
        assert stage_map.stages_of("model.embed_tokens.weight") == (0, num_stages - 1)
    for section in manifest.stages:
        held = set(section.tensors)
        assert section.tensors == stage_map.names(section.stage, list(state))
        assert section.state_sha256 == state_hash({name: state[name] for name in held})
        read = part(manifest, section.stage)
        payload = b"".join(bytes(data) for entry, data in pieces if entry in read.chunks)
        assert read.payload_bytes == len(payload) < manifest.payload_bytes
        mirror: dict[str, torch.Tensor] = {}
        sync_module.decode_state(read.tensors, payload, mirror)  # its chunks alone decode its tensors
        assert same_bits(mirror, {name: state[name] for name in held})
        others = {i for s in manifest.stages if s.stage != section.stage for i in s.chunks} - set(
            section.chunks
        )
        assert others or num_stages == 1  # chunks it never downloads
    # Every tensor is held by the sections the map says, and shared bytes are only the tied matrix's.
    shared = set(manifest.stages[0].chunks) & set(manifest.stages[-1].chunks)
    assert bool(shared) == stage_map.tied_embeddings
    stage_bytes = index_entry(manifest).stage_bytes
    assert stage_bytes is not None and len(stage_bytes) == num_stages
    assert sum(stage_bytes) >= manifest.payload_bytes and max(stage_bytes) < manifest.payload_bytes


def test_layout_refuses_mixed_chunks_missing_tensors_and_a_map_that_does_not_fit() -> None:
    state, config = small_state("qwen2-tied")
    stage_map = StageMap.for_model(2, None, config)
    assert stage_map is not None
    staging = Staging(stage_map, stage_hashes(state, stage_map) or [])
    manifest, _ = build_manifest(0, None, state, "bfloat16", 1024, state_hash(state), staging=staging)
    assert manifest.stages is not None
    # Chunks cut without the group boundaries: some chunk holds two stages' bytes.
    from decentrl.weights.codec import encode_state

    entries, payload = encode_state(
        None, state, [n for group in tensor_groups(stage_map, list(state)) for n in group]
    )
    mixed, _ = _manifest(
        0, "snapshot", entries, payload, "bfloat16", 1 << 20, state_hash(state), {}, staging, None
    )
    assert "different stages" in (check_layout(mixed) or "")
    section = manifest.stages[1]
    dropped = section.model_copy(update={"tensors": section.tensors[1:]})
    assert "exactly the tensors" in check_layout(
        manifest.model_copy(update={"stages": [manifest.stages[0], dropped]})
    )
    fewer = section.model_copy(update={"chunks": section.chunks[1:]})
    assert "exactly the chunks" in check_layout(
        manifest.model_copy(update={"stages": [manifest.stages[0], fewer]})
    )
    assert "one section per stage" in check_layout(
        manifest.model_copy(update={"stages": manifest.stages[:1]})
    )
    assert "neither" in check_layout(manifest.model_copy(update={"stages": None}))
    untied = stage_map.model_copy(update={"tied_embeddings": False})
    assert "tied_embeddings" in check_layout(manifest.model_copy(update={"stage_map": untied}))
    longer = StageMap(bounds=(0, 2, 6), tied_embeddings=True)
    assert "covers 6 layers" in check_layout(manifest.model_copy(update={"stage_map": longer}))
    shorter = StageMap(bounds=(0, 1, 3), tied_embeddings=True)
    assert "layer 3" in check_layout(manifest.model_copy(update={"stage_map": shorter}))
    linked = section.model_copy(update={"parent_state_sha256": "0" * 64})
    assert "base state hash" in check_layout(
        manifest.model_copy(update={"stages": [manifest.stages[0], linked]})
    )


def test_the_signature_binds_the_sections_and_unstaged_bytes_are_unchanged(tmp_path: Path) -> None:
    state, config = small_state("llama-untied")
    stage_map = StageMap.for_model(2, None, config)
    assert stage_map is not None
    unstaged, _ = build_manifest(0, None, state, "bfloat16", 1024, state_hash(state))
    assert b"stage" not in signed_bytes(unstaged)  # older manifests keep their signatures
    memory = Memory()
    publisher = publisher_for(memory, stage_map, tmp_path)
    publisher.publish_state(state, 0)
    signed = memory.manifest(0, "snapshot")
    key = parse_public_key(publisher.public_key)
    verify(signed, key)
    assert signed.stages is not None
    wrong = signed.stages[1].model_copy(update={"state_sha256": "0" * 64})
    with pytest.raises(BadSignature):
        verify(signed.model_copy(update={"stages": [signed.stages[0], wrong]}), key)
    with pytest.raises(BadSignature):
        verify(
            signed.model_copy(update={"stage_map": StageMap(bounds=(0, 1, 4), tied_embeddings=False)}), key
        )


@pytest.mark.parametrize(("kind", "num_stages"), [("qwen2-tied", 2), ("llama-untied", 3), ("qwen2-tied", 3)])
def test_each_stage_holder_fetches_and_rebuilds_only_its_stage(
    kind: str, num_stages: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = [small_state(kind)[0]]
    stage_map = StageMap.for_model(num_stages, None, small_state(kind)[1])
    assert stage_map is not None
    memory = Memory()
    publisher = publisher_for(memory, stage_map, tmp_path)
    publisher.publish_state(states[0], 0)
    states.append(moved(states[0], seed=1))  # every tensor moves, the tied matrix too
    publisher.publish_state(states[1], 1)
    for version in (2, 3, 4):  # few elements of one layer and of the embedding: patches pay
        states.append(moved(moved(states[-1], version, 0.01, "layers.1."), version + 10, 0.01, "embed"))
        publisher.publish_state(states[-1], version)
    assert any(p.kind == "patch" for p in publisher.history)
    for published in publisher.history:  # bytes per stage vs the whole, as the publisher reports them
        assert published.stage_bytes is not None and max(published.stage_bytes) <= published.payload_bytes
        assert min(published.stage_bytes) < published.payload_bytes

    decoded: list[str] = []
    real_decode = sync_module.decode_state

    def recording(entries, payload, base):  # noqa: ANN001, ANN202 - decode_state's
        entries = list(entries)
        decoded.extend(entry.name for entry in entries)
        return real_decode(entries, payload, base)

    monkeypatch.setattr(sync_module, "decode_state", recording)
    for stage in range(num_stages):
        names = stage_map.names(stage, list(states[0]))
        memory.requested.clear()
        decoded.clear()
        sync = holder(memory, publisher, tmp_path / f"holder-{stage}", stage, stage_map)
        sync.sync_to(1)
        assert sync.routes[-1][2].steps == [(0, "snapshot"), (1, "delta")]
        route_manifests = [(0, "snapshot", None), (1, "delta", None)]
        assert set(memory.requested) == section_digests(memory, route_manifests, stage)
        assert len(memory.requested) == len(set(memory.requested))
        assert sync.store.digests() == set(memory.requested)  # it holds (and could serve) nothing else
        assert sorted(sync.state) == names and set(decoded) <= set(names)
        assert same_bits(sync.state, {name: states[1][name] for name in names})
        # The deltas 2..4 hidden: one patch (anchor v0) brings v1 to v4.
        memory.hidden = {(v, "delta", None) for v in (2, 3, 4)}
        memory.requested.clear()
        sync.sync_to(4)
        memory.hidden = set()
        route = sync.routes[-1][2]
        assert route.steps == [(4, "patch")] and route.anchors == {4: 0}
        assert set(memory.requested) <= section_digests(memory, [(4, "patch", 0)], stage)
        assert same_bits(sync.state, {name: states[4][name] for name in names})
        assert set(decoded) <= set(names)
        assert route.num_bytes == part(memory.manifest(4, "patch", 0), stage).payload_bytes
    # A full-model consumer reads the same staged manifests whole.
    whole = holder(memory, publisher, tmp_path / "whole", None, None)
    whole.sync_to(4)
    assert same_bits(whole.state, states[4]) and whole.state_sha256 == state_hash(states[4])


def staged_history(tmp_path: Path) -> tuple[Memory, Publisher, StageMap, list[dict]]:
    state, config = small_state("qwen2-tied")
    stage_map = StageMap.for_model(2, None, config)
    assert stage_map is not None
    memory = Memory()
    publisher = publisher_for(memory, stage_map, tmp_path, patches=False)
    states = [state, moved(state, seed=1)]
    for version, each in enumerate(states):
        publisher.publish_state(each, version)
    return memory, publisher, stage_map, states


def test_a_forged_chunk_is_refused_and_nothing_is_applied(tmp_path: Path) -> None:
    memory, publisher, stage_map, _ = staged_history(tmp_path)
    digests = section_digests(memory, [(0, "snapshot", None)], 1)
    memory.forged = digests
    sync = holder(memory, publisher, tmp_path / "holder", 1, stage_map)
    with pytest.raises((VerificationFailed, NoRoute)):
        sync.sync_to(1)
    assert sync.version is None and sync.state == {}
    assert sync.store.digests().isdisjoint(digests)
    assert sync.fetcher.rejected_from["coordinator"] >= 1


def test_a_wrong_stage_hash_is_refused_even_when_signed(tmp_path: Path) -> None:
    memory, publisher, stage_map, states = staged_history(tmp_path)
    delta = memory.manifest(1, "delta")
    assert delta.stages is not None
    # The trainer's own key signs a section whose stage hash is wrong: the rebuilt stage disagrees.
    wrong = delta.stages[1].model_copy(
        update={"state_sha256": state_hash({"x": states[0]["model.norm.weight"]})}
    )
    forged = sign(
        delta.model_copy(update={"stages": [delta.stages[0], wrong], "signature": ""}), publisher.key
    )
    memory.upload_manifest(1, "delta", forged.model_dump_json().encode())
    sync = holder(memory, publisher, tmp_path / "holder-1", 1, stage_map)
    with pytest.raises(VerificationFailed, match="stage 1: reconstructed state hash"):
        sync.sync_to(1)
    assert sync.version is None and sync.state == {}  # the half-applied mirror is dropped
    # Stage 0's section is intact: its holder reaches v1 from the same manifests.
    other = holder(memory, publisher, tmp_path / "holder-0", 0, stage_map)
    other.sync_to(1)
    assert same_bits(other.state, {name: states[1][name] for name in stage_map.names(0, list(states[1]))})
    # A parent stage hash that is not the held stage's breaks the chain before any byte is fetched.
    linked = delta.stages[0].model_copy(update={"parent_state_sha256": "0" * 64})
    unlinked = sign(
        delta.model_copy(update={"stages": [linked, delta.stages[1]], "signature": ""}), publisher.key
    )
    memory.upload_manifest(1, "delta", unlinked.model_dump_json().encode())
    behind = holder(memory, publisher, tmp_path / "holder-0b", 0, stage_map)
    memory.hidden = {(1, "delta", None)}
    behind.sync_to(0)
    memory.hidden = set()
    memory.requested.clear()
    with pytest.raises((VerificationFailed, NoRoute)):
        behind._check_chain([memory.manifest(1, "delta")])
    assert memory.requested == []


def test_a_holder_refuses_another_stage_map_and_an_unstaged_run(tmp_path: Path) -> None:
    memory, publisher, stage_map, _ = staged_history(tmp_path)
    other = StageMap(bounds=(0, 1, 4), tied_embeddings=True)
    sync = holder(memory, publisher, tmp_path / "holder", 0, other)
    with pytest.raises((VerificationFailed, NoRoute)):
        sync.sync_to(1)
    assert sync.rejected_manifests >= 1 and sync.store.digests() == set()
    unstaged = Memory()
    plain = publisher_for(unstaged, None, tmp_path / "plain")
    plain.publish_state(small_state("qwen2-tied")[0], 0)
    with pytest.raises(NoRoute):  # an unstaged index prices no stage: no route for a holder
        plan(None, 0, unstaged.weights_index(), stage=0)


def test_the_coordinator_keeps_the_stage_map_of_the_published_versions(tmp_path: Path) -> None:
    memory, _, stage_map, _ = staged_history(tmp_path)
    store = WeightStore.__new__(WeightStore)  # only the restart check: no database needed
    store.manifests = {(0, "snapshot", None): memory.manifest(0, "snapshot")}
    store.stage_map = stage_map
    store._check_stage_map()
    store.stage_map = None
    with pytest.raises(ConfigError, match="fixed for a run"):
        store._check_stage_map()
