"""MODEL positional on every command that takes a model (pagedserve.model_arg), and `serve`
resolving a hub id once before its children start (serve_cmd.pin_model), offline from a
hub cache written here."""
import shlex

import pytest
from huggingface_hub import constants

from pagedserve.cli import build_parser
from pagedserve.executor.errors import ModelLoadError
from pagedserve.serve_cmd import pin_model, service_specs
from tests.support.hub_cache import write_snapshot


@pytest.mark.parametrize("command", ["serve", "executor", "generate --prompt hi", "bench throughput",
                                     "bench profile", "bench sharing"])
def test_model_is_positional_wherever_a_command_takes_one(command):
    parser = build_parser()
    assert parser.parse_args(shlex.split(f"{command} Qwen/Qwen2.5-0.5B-Instruct")).model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert parser.parse_args(shlex.split(f"{command} --model ./m")).model == "./m"
    assert parser.parse_args(shlex.split(command)).model is None


def test_model_positional_goes_anywhere_among_the_flags():
    args = build_parser().parse_args(shlex.split("serve --kv-tokens 512 org/m --revision v1 --served-model-name x"))
    assert (args.model, args.revision, args.served_model_name, args.kv_tokens) == ("org/m", "v1", ["x"], 512)


@pytest.mark.parametrize("flags", ["--served-model-name a b", "--served-model-name a --served-model-name b"])
def test_served_model_name_takes_several_names_as_vllms(flags):
    args = build_parser().parse_args(shlex.split(f"serve org/m {flags} --kv-tokens 512"))
    assert (args.model, args.served_model_name, args.kv_tokens) == ("org/m", ["a", "b"], 512)


def test_serve_hands_every_executor_and_gateway_the_names_and_the_revision():
    args = build_parser().parse_args(shlex.split("serve org/m --revision v1 --served-model-name mine also "
                                                 "--replicas 2 --gateways 2"))
    specs = service_specs(args)
    executors = [s for s in specs if s.name.startswith("executor")]
    assert len(executors) == 2
    for spec in executors:
        argv = " ".join(spec.argv)
        assert "--model org/m" in argv and "--revision v1" in argv
    for spec in executors + [s for s in specs if s.name.startswith("gateway")]:
        assert "--served-model-name mine --served-model-name also" in " ".join(spec.argv), spec.name


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "hub"


def test_serve_resolves_a_hub_id_once_and_children_load_the_snapshot_by_the_ids_name(cache):
    path = write_snapshot(cache, "tiny-org/tiny-llama", arch="llama3")
    args = build_parser().parse_args(shlex.split("serve tiny-org/tiny-llama"))
    pin_model(args)
    assert (args.model, args.served_model_name, args.revision) == (path, ["tiny-org/tiny-llama"], None)
    argv = " ".join(next(s for s in service_specs(args) if s.name == "executor").argv)
    assert f"--model {path}" in argv and "--served-model-name tiny-org/tiny-llama" in argv
    assert "--revision" not in argv


def test_serve_fails_before_starting_anything_when_the_model_cannot_be_had(cache, capsys):
    from pagedserve.serve_cmd import run_serve

    assert run_serve(build_parser().parse_args(shlex.split("serve tiny-org/absent"))) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedserve serve: tiny-org/absent") and "HF_HUB_OFFLINE=1" in err
    with pytest.raises(ModelLoadError, match="no such model directory"):
        pin_model(build_parser().parse_args(shlex.split("serve ./absent")))
    args = build_parser().parse_args(shlex.split("serve --zero-cost org/whatever"))
    pin_model(args)  # a model-free executor loads nothing: nothing to resolve
    assert args.model == "org/whatever"


def test_advise_reads_a_hub_ids_config_from_the_cache(cache, capsys):
    from pagedserve.advise import load_shape

    write_snapshot(cache, "tiny-org/tiny-llama", arch="llama3")
    shape = load_shape("tiny-org/tiny-llama")
    assert (shape.name, shape.num_layers, shape.hidden_size) == ("tiny-org/tiny-llama", 2, 64)
    for model, status in (("opt-13b", 0), ("tiny-org/tiny-llama", 0), ("tiny-org/absent", 2)):
        args = build_parser().parse_args(["advise", model])
        assert args.run(args) == status
    assert "pagedserve advise: tiny-org/absent" in capsys.readouterr().err
