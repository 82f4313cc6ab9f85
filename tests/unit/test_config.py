"""Config loading (defaults < file < overrides) and the CLI's one-line errors."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import decentrl
from decentrl.cli import main
from decentrl.config import DEMO_CONFIG, ConfigError, RunConfig, load_config


def test_no_file_means_the_pydantic_defaults() -> None:
    assert load_config() == RunConfig()
    assert load_config(None, ["trainer.lr=3e-4"]).trainer.lr == 3e-4


def test_demo_config_is_package_data_and_only_the_demo_reads_it() -> None:
    assert DEMO_CONFIG.is_relative_to(Path(decentrl.__file__).parent)  # installed with the package
    config = load_config(DEMO_CONFIG)
    tree = tomllib.loads(DEMO_CONFIG.read_text())
    for section in ("task", "sft", "trainer", "coordinator"):
        for key, value in tree[section].items():
            assert getattr(getattr(config, section), key) == value, f"{section}.{key}"
    assert config.task.args != RunConfig().task.args  # the file really was read
    # fields the file does not set keep their defaults
    assert config.trainer.weight_decay == 0.0
    assert config.coordinator.port == 8760
    assert config.model.path is None


def test_overrides_beat_the_file() -> None:
    config = load_config(DEMO_CONFIG, ["trainer.lr=3e-4", "model.path=/x", "demo.num_workers=3", "seed=7"])
    assert config.trainer.lr == 3e-4  # file says 1e-3
    assert config.model.path == "/x"  # a bare string needs no quotes
    assert config.demo.num_workers == 3  # file says 2
    assert config.seed == 7
    assert config.trainer.eval_every == 25  # untouched fields keep the file's values
    assert config.algorithm.correction.cap == 2.0
    assert config.task.args["num_digits"] == 2


def test_config_show_prints_the_resolved_config(capsys) -> None:
    assert main(["config", "show"]) == 0
    assert tomllib.loads(capsys.readouterr().out) == RunConfig().model_dump(mode="json", exclude_none=True)
    assert main(["config", "show", "--demo", "--set", "trainer.lr=0.5", "--section", "trainer"]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert shown == {
        "trainer": load_config(DEMO_CONFIG, ["trainer.lr=0.5"]).trainer.model_dump(exclude_none=True)
    }
    assert main(["config", "show", "--section", "trainr"]) == 2
    assert "unknown section 'trainr'" in capsys.readouterr().err


def test_file_beats_defaults_and_override_beats_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[trainer]\nlr = 0.25\nnum_steps = 9\n")
    config = load_config(path, ["trainer.num_steps=11"])
    assert config.trainer.lr == 0.25
    assert config.trainer.num_steps == 11
    assert config.trainer.eval_every == RunConfig().trainer.eval_every
    assert config.task.args == {}  # a user file replaces the demo config, it is not layered on it


def test_unknown_key_names_it_and_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["trainer.lrr=1e-3"])
    message = str(error.value)
    assert "trainer.lrr" in message
    for valid in ("lr", "max_grad_norm", "groups_per_step"):
        assert valid in message


def test_unknown_section_is_an_error() -> None:
    with pytest.raises(ConfigError, match="bogus"):
        load_config(overrides=["bogus.x=1"])


@pytest.mark.parametrize("override", ["trainer.lr=-1", "trainer.lr=fast", "coordinator.group_size=1"])
def test_bad_value_names_the_field(override: str) -> None:
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(overrides=[override])


def test_malformed_override() -> None:
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(overrides=["trainer.lr"])


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found; pass an existing .toml, a packaged config \\(demo\\)"):
        load_config(tmp_path / "nope.toml")


def test_the_demo_config_is_named_by_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--config demo` reads the packaged demo config from any directory, as `extends = "demo"`
    does; a file called `demo` in the working directory is read instead."""
    monkeypatch.chdir(tmp_path)
    assert load_config("demo", ["trainer.num_steps=7"]) == load_config(DEMO_CONFIG, ["trainer.num_steps=7"])
    assert load_config("demo") != load_config()
    (tmp_path / "demo").write_text("[trainer]\nlr = 0.5\n")
    assert load_config("demo").trainer.lr == 0.5


def test_invalid_toml(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[trainer\nlr = \n")
    with pytest.raises(ConfigError, match="broken.toml"):
        load_config(path)


def test_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"trainer": ')
    with pytest.raises(ConfigError, match="broken.json"):
        load_config(path)


def test_json_round_trip(tmp_path: Path) -> None:
    config = load_config(DEMO_CONFIG, ["trainer.lr=3e-4", "model.path=/x", "worker.token=secret", "seed=5"])
    path = tmp_path / "resolved.json"
    path.write_text(config.model_dump_json())
    assert load_config(path) == config
    assert load_config(path) != load_config()


# ---------------------------------------------------------------- CLI errors


def one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("decentrl: error:"), lines[0]
    assert "Traceback" not in captured.err
    return lines[0]


def test_cli_unknown_flag(capsys, tmp_path: Path) -> None:
    line = one_error_line(capsys, ["coordinator", "--run-dir", str(tmp_path), "--frobnicate"])
    assert "--frobnicate" in line


def test_cli_prints_its_version(capsys) -> None:
    from decentrl import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"decentrl {__version__}"


def test_cli_unknown_command(capsys) -> None:
    one_error_line(capsys, ["fly"])


def test_cli_unknown_config_key(capsys, tmp_path: Path) -> None:
    line = one_error_line(capsys, ["coordinator", "--run-dir", str(tmp_path), "--set", "trainer.nope=1"])
    assert "trainer.nope" in line


def test_cli_missing_config_file(capsys, tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    line = one_error_line(capsys, ["coordinator", "--run-dir", str(tmp_path), "--config", str(missing)])
    assert "missing.toml" in line


def test_cli_model_dir_without_config_json(capsys, tmp_path: Path) -> None:
    line = one_error_line(
        capsys, ["coordinator", "--run-dir", str(tmp_path / "run"), "--model-dir", str(tmp_path)]
    )
    assert "config.json" in line


def test_algorithm_variants_are_chosen_by_name_with_their_own_fields(tmp_path: Path) -> None:
    path = tmp_path / "dapo.toml"
    path.write_text(
        '[algorithm.loss]\nname = "dapo"\neps_high = 0.3\n[algorithm.correction]\nname = "m2po"\n'
    )
    config = load_config(path, ["algorithm.advantage.name='rloo'"])
    assert config.algorithm.loss.name == "dapo" and config.algorithm.loss.eps_high == 0.3
    assert config.algorithm.loss.dynamic_sampling is True  # the variant's own default
    assert config.algorithm.correction.tau == 0.04
    assert config.algorithm.advantage.name == "rloo"


def test_unknown_algorithm_variant_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="algorithm.loss") as error:
        load_config(overrides=["algorithm.loss.name='ppo2'"])
    assert "ppo_clip" in str(error.value)  # names the valid choices
    with pytest.raises(ConfigError, match="eps_hihg"):
        load_config(overrides=["algorithm.loss.eps_hihg=0.3"])


def test_extends_layers_a_file_on_its_base(tmp_path: Path) -> None:
    base = tmp_path / "base.toml"
    base.write_text(
        'seed = 3\n[trainer]\nlr = 0.5\nnum_steps = 9\n[algorithm.correction]\nname = "tis"\ncap = 3.0\n'
    )
    top = tmp_path / "sub" / "top.toml"
    top.parent.mkdir()
    top.write_text('extends = "../base.toml"\n[trainer]\nlr = 0.25\n[algorithm.correction]\nname = "m2po"\n')
    config = load_config(top)
    assert config.seed == 3 and config.trainer.num_steps == 9  # from the base
    assert config.trainer.lr == 0.25  # the file wins over its base
    # a variant whose name changes replaces the base's variant (tis's `cap` does not leak into m2po)
    assert config.algorithm.correction.name == "m2po"
    top.write_text('extends = "top.toml"\n')
    with pytest.raises(ConfigError, match="cycle"):
        load_config(top)


def test_every_algorithm_preset_loads_on_the_demo_config() -> None:
    presets = sorted((Path(__file__).parents[2] / "configs" / "algo").glob("*.toml"))
    assert len(presets) >= 8
    demo = load_config(DEMO_CONFIG)
    for preset in presets:
        config = load_config(preset)
        assert config.task == demo.task and config.trainer.num_steps == demo.trainer.num_steps, preset


def test_every_shipped_run_config_loads() -> None:
    """The configs README and docs point at (configs/*.toml) are valid, field for field."""
    shipped = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))
    assert len(shipped) >= 8
    for path in shipped:
        load_config(path)
    browser = load_config(Path(__file__).parents[2] / "configs" / "browser.toml")
    assert browser.task.served and browser.sft.demonstrations == 9600 and browser.sft.teacher_skip_tool == 0.6


def test_sft_demonstrations_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="sft.demonstrations"):
        load_config(overrides=["sft.demonstrations=0"])


def test_variant_field_errors_name_the_field_without_the_variant_tag() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(overrides=["algorithm.correction.cap=-1"])
    assert "'algorithm.correction.cap'" in str(error.value) and "greater than 1" in str(error.value)


def test_bench_argument_errors_are_one_line(capsys) -> None:
    line = one_error_line(capsys, ["bench", "staleness", "--corrections", "bogus"])
    assert "invalid choice: 'bogus'" in line and "none+dual_clip" in line


def test_trainer_adopts_the_coordinators_sections_or_refuses_a_different_one() -> None:
    from decentrl.config import adopt_coordinator_sections

    coordinator = load_config(DEMO_CONFIG)
    sections = {name: getattr(coordinator, name).model_dump() for name in ("model", "task", "sft")}
    adopted = adopt_coordinator_sections(RunConfig(), sections, "trainer")  # defaults: take theirs
    assert (adopted.model, adopted.task, adopted.sft) == (
        coordinator.model,
        coordinator.task,
        coordinator.sft,
    )
    assert adopted.trainer == RunConfig().trainer  # the role's own sections stay its own
    assert adopt_coordinator_sections(coordinator, sections, "trainer") == coordinator  # same: fine
    mismatched = load_config(None, ["task.env='tool_use'"])
    with pytest.raises(
        ConfigError,
        match=r"trainer's \[task\] differs from the coordinator's: task.env = 'tool_use' \(coordinator: 'arithmetic'\)",
    ):
        adopt_coordinator_sections(mismatched, sections, "trainer")


def test_a_batch_larger_than_the_pending_groups_is_refused_at_load(capsys) -> None:
    """The coordinator stops creating groups at max_pending_groups: a larger batch never fills."""
    too_big = ["trainer.groups_per_step=13", "coordinator.max_pending_groups=12"]
    with pytest.raises(ConfigError, match="groups_per_step=13 exceeds coordinator.max_pending_groups=12"):
        load_config(None, too_big)
    assert load_config(None, ["trainer.groups_per_step=12", "coordinator.max_pending_groups=12"])
    # The CLI says so in one line, before starting anything.
    assert main(["config", "show", *(f"--set={override}" for override in too_big)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_minibatch_smaller_than_the_ranks_is_refused_at_load() -> None:
    # 2 groups x 4 sequences in 4 mini-batches: 2 sequences each, for 4 ranks
    small = ["trainer.groups_per_step=2", "coordinator.group_size=4", "trainer.minibatches_per_version=4"]
    with pytest.raises(ConfigError, match="mini-batch of 2 sequences .* each of 4 trainer ranks"):
        load_config(None, [*small, "trainer.nproc=4"])
    assert load_config(None, [*small, "trainer.nproc=2"])


def test_config_show_docs_puts_each_fields_docstring_above_it_and_reads_back(capsys, tmp_path: Path) -> None:
    assert main(["config", "show", "--docs", "--set", "trainer.lr=3e-4"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    # The docstring of `sft.steps`, word for word, right above its value.
    assert (
        lines[lines.index("steps = 1500") - 1]
        == "# Warm-start optimizer steps (0 = start RL from the random init)."
    )
    assert "# path = (unset)" in lines  # None fields are shown, commented out
    written = tmp_path / "shown.toml"
    written.write_text(text)
    assert load_config(written, []) == load_config(None, ["trainer.lr=3e-4"])
    assert main(["config", "show", "--docs", "--section", "sft"]) == 0
    assert capsys.readouterr().out.startswith("[sft]\n# Warm-start optimizer steps")


def test_colocated_settings_that_cannot_work_are_refused_at_load() -> None:
    """A colocated trainer needs room for its round ahead, one process and no stages; a demo
    without workers needs a colocated trainer."""
    base = ["trainer.groups_per_step=4", "trainer.local_groups=4"]
    with pytest.raises(ConfigError, match=r"max_pending_groups >= 16 .* not 12"):
        load_config(None, [*base, "coordinator.max_pending_groups=12"])
    assert load_config(None, [*base, "coordinator.max_pending_groups=16"]).trainer.local_groups == 4
    with pytest.raises(ConfigError, match="trainer.nproc=1"):
        load_config(None, [*base, "coordinator.max_pending_groups=16", "trainer.nproc=2"])
    with pytest.raises(ConfigError, match="staged run"):
        load_config(None, [*base, "coordinator.max_pending_groups=16", "model.num_stages=2"])
    with pytest.raises(ConfigError, match="nobody to sample"):
        load_config(None, ["demo.num_workers=0"])


def test_demo_colocate_sets_the_mode_and_its_room() -> None:
    from decentrl.launch.local import colocated

    demo = load_config(DEMO_CONFIG, ["coordinator.max_pending_groups=16"])
    config = colocated(demo, 0)
    assert config.trainer.local_groups == config.trainer.groups_per_step == 16
    assert config.coordinator.max_pending_groups == 64 and config.demo.num_workers == 0
    assert (
        colocated(
            load_config(DEMO_CONFIG, ["coordinator.max_pending_groups=80"]), None
        ).coordinator.max_pending_groups
        == 80
    )
    assert colocated(demo, None).demo.num_workers == demo.demo.num_workers  # workers kept unless told
