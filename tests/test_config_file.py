"""A run a user can read and keep (issue 36): --help grouped by concern, a run described by a TOML
file (--config), and the resolved settings written beside the log and into the checkpoint
directory, which --config reads back to the same run."""
import json
import re

import pytest

from conftest import run_main
from manual_dp.cli import config_file
from manual_dp.cli.options import base_type, build_parser, parse
from manual_dp.config import GROUPS, fields
from manual_dp.errors import UsageError

tomllib = pytest.importorskip("tomllib")            # --config needs Python 3.11's

TINY = ["--epochs", "1", "--train-size", "256", "--test-size", "64", "--cpus", "1", "--no-progress"]


def sections_of_help():
    """[(section title, [the flags listed under it])] of --help, in order."""
    sections = []
    for line in build_parser().format_help().splitlines():
        if re.fullmatch(r"\S.*:", line):
            sections.append((line[:-1], []))
        elif sections and re.match(r"  -", line):                 # a flag's line: its names, then its help
            invocation = re.match(r"  (-\S.*?)(?:\s{2,}|$)", line).group(1)
            sections[-1][1].extend(re.findall(r"--[\w-]+", invocation))
    return sections


def write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_help_has_the_groups_in_order():
    assert [title for title, _ in sections_of_help()] == ["options", *GROUPS]


def test_every_flag_is_in_exactly_one_group_its_own():
    listed = {}
    for title, flags in sections_of_help():
        for flag in flags:
            listed.setdefault(flag, []).append(title)
    for f in fields():
        assert listed.pop("--" + f.name.replace("_", "-")) == [f.metadata["group"]], f.name
    assert set(listed) == {"--help", "--config"} | {"--no-" + f.name.replace("_", "-") for f in fields()
                                                    if f.default is None and base_type(f.type) is bool}
    assert listed["--config"] == ["options"]


def test_a_flag_of_an_unknown_group_is_refused():
    from manual_dp.config import flag
    with pytest.raises(ValueError, match="not one of devices, model"):
        flag(1, "help", "training")


def test_gpus_and_cpus_stay_exclusive():
    with pytest.raises(UsageError, match="--cpus: not allowed with argument --gpus"):
        parse(["--gpus", "1", "--cpus", "2"])


def test_a_config_file_sets_values(tmp_path):
    path = write(tmp_path, '[model]\nmodel = "transformer"\nlayers = 3\n[parallelism]\nmode = "tensor"\n'
                           'deterministic = true\n[devices]\ncpus = 4\n[optimisation]\nbatch-size = 64\nlr = 0.5\n')
    cfg = parse(["--config", path])
    assert (cfg.model, cfg.layers, cfg.mode, cfg.deterministic, cfg.cpus, cfg.batch_size, cfg.lr) == \
        ("transformer", 3, "tensor", True, 4, 64, 0.5)
    assert cfg == parse(["--model", "transformer", "--layers", "3", "--mode", "tensor", "--deterministic",
                         "--cpus", "4", "--batch-size", "64", "--lr", "0.5"])


def test_an_integer_is_taken_for_a_float(tmp_path):
    cfg = parse(["--config", write(tmp_path, "[optimisation]\nlr = 1\n")])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)


def test_flags_override_the_file(tmp_path):
    path = write(tmp_path, "[optimisation]\nlr = 0.5\nepochs = 3\n[parallelism]\nmode = \"zero\"\n")
    cfg = parse(["--lr", "0.1", "--config", path, "--mode", "sync"])
    assert (cfg.lr, cfg.epochs, cfg.mode) == (0.1, 3, "sync")


def test_a_device_flag_replaces_the_files_devices(tmp_path):
    path = write(tmp_path, "[devices]\ngpus = 1\nmemory_per_device = \"64MiB\"\n")
    cfg = parse(["--config", path, "--cpus", "2"])
    assert (cfg.gpus, cfg.cpus, cfg.memory_per_device) == (None, 2, "64MiB")


def test_the_files_values_are_checked_as_the_flags_are(tmp_path):
    with pytest.raises(UsageError, match="--batch-size must be >= 1, got 0"):
        parse(["--config", write(tmp_path, "[optimisation]\nbatch_size = 0\n")])


BAD = {
    "missing file": (None, r"--config \S+nowhere.toml: cannot read it \(No such file or directory\)"),
    "a directory": ("DIR", r"cannot read it \(Is a directory\)"),
    "not UTF-8": (b"\xff\xfe[model]", r"not a TOML file \(not UTF-8 text\)"),
    "invalid TOML": ('[model]\nmodel = "lenet"\nwidth = \n', r"not valid TOML: .*at line 3"),
    "unknown section": ("[modle]\nwidth = 2\n", r"unknown section \[modle\]: did you mean \[model\]\?"),
    "unknown key": ("[model]\nlayer = 2\n", r"unknown key layer in \[model\]: did you mean layers\?"),
    "unknown key of another section": ("[model]\nepoch = 2\n",
                                       r"unknown key epoch in \[model\]: did you mean epochs \(in \[optimisation\]\)\?"),
    "key in the wrong section": ("[model]\nlr = 0.1\n", r"lr belongs in \[optimisation\], not \[model\]"),
    "key outside every section": ("epochs = 2\n", r"epochs is outside every section: put it under \[optimisation\]"),
    "int for a bool": ("[parallelism]\ndeterministic = 1\n",
                       r"\[parallelism\] deterministic must be true or false, not an integer \(1\)"),
    "bool for an int": ("[optimisation]\nepochs = true\n", r"epochs must be an integer, not a boolean \(true\)"),
    "float for an int": ("[optimisation]\nepochs = 2.0\n", r"epochs must be an integer, not a float \(2.0\)"),
    "str for an int": ('[optimisation]\nepochs = "2"\n', r'epochs must be an integer, not a string \("2"\)'),
    "str for a float": ('[optimisation]\nlr = "0.1"\n', r'lr must be a number, not a string \("0.1"\)'),
    "int for a str": ("[model]\nmodel = 5\n", r"model must be a string, not an integer \(5\)"),
    "not a choice": ('[parallelism]\nmode = "tensr"\n', r"\[parallelism\] mode: invalid choice 'tensr' \(choose from"),
    "gpus and cpus": ("[devices]\ngpus = 1\ncpus = 2\n", r"\[devices\] sets gpus and cpus: give one of them"),
    "a key twice": ("[optimisation]\nbatch-size = 1\nbatch_size = 2\n", r"batch_size sets batch_size a second time"),
}


@pytest.mark.parametrize("content,message", BAD.values(), ids=BAD.keys())
def test_a_bad_file_ends_in_one_line_and_exit_2(capsys, tmp_path, content, message):
    path = tmp_path / "nowhere.toml"
    if content == "DIR":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    code, out, err = run_main(capsys, ["--config", str(path), "--cpus", "1"])
    assert code == 2 and len(err) == 1 and err[0].startswith("manual_dp.train: error: --config "), err
    assert re.search(message, err[0]), err[0]


ROUND_TRIPS = [
    [],
    ["--model", "transformer", "--mode", "tensor", "--deterministic"],
    ["--mesh", "dp=2,pp=2", "--cpus", "4"],
    ["--mesh", "pp=2,tp=2", "--cpus", "4", "--model", "transformer", "--schedule", "1f1b"],
    ["--mesh", "dp=2,cp=2", "--cpus", "4", "--model", "transformer", "--deterministic", "--attention", "ulysses"],
    ["--mesh", "dp=2", "--mode", "zero", "--zero-stage", "3"],
    ["--deterministic", "--cpus", "3"],                           # allreduce, fuse_grads: resolved, not written
    ["--compress", "2bit"],                                       # allreduce: gathered instead, not written
    ["--mode", "local"],                                          # outer_momentum: without nesterov, not written
    ["--mode", "local", "--outer-optimizer", "nesterov", "--outer-lr", "0.7"],
    ["--precision", "fp16", "--mode", "pipeline", "--micro-batches", "2", "--recompute"],
    ["--gpus", "1", "--no-graph", "--bucket-mb", "0", "--lr", "1e-5", "--warmup-epochs", "0.5"],
    ["--log-json", 'runs/a "b"\\c\té.jsonl', "--checkpoint-dir", "ck", "--resume", "--backend", "horovod"],
]


@pytest.mark.parametrize("argv", ROUND_TRIPS, ids=lambda a: " ".join(a) or "default")
def test_the_written_settings_read_back_to_the_same_run(tmp_path, argv):
    cfg = parse(argv)
    path = write(tmp_path, config_file.dumps(cfg), "config.toml")
    assert parse(["--config", path]) == cfg


def test_the_written_file_holds_every_set_field_in_its_section():
    cfg = parse(["--model", "transformer", "--mode", "tensor", "--cpus", "2", "--log-json", "x.jsonl"])
    document = tomllib.loads(config_file.dumps(cfg))
    assert list(document) == list(GROUPS)                                # data: --data's default
    assert document["data"] == {"data": "fashion-mnist"}
    written = {key: (section, value) for section, table in document.items() for key, value in table.items()}
    assert written == {f.name: (f.metadata["group"], getattr(cfg, f.name)) for f in fields()
                       if getattr(cfg, f.name) is not None}
    assert written["allreduce"] == ("parallelism", "reduce_bcast") and written["heads"] == ("model", 4)


def test_a_mesh_is_written_with_the_mode_it_chose():
    """--mesh dp=2,pp=2 is resolved to --mode hybrid --stages 2: the file holds all three, which
    with_mesh accepts together (the mesh's own mode and degree), and reads back to the same run."""
    cfg = parse(["--mesh", "dp=2,pp=2", "--cpus", "4"])
    parallelism = tomllib.loads(config_file.dumps(cfg))["parallelism"]
    assert (parallelism["mesh"], parallelism["mode"], parallelism["stages"]) == ("dp=2,pp=2", "hybrid", 2)
    assert parse(["--mesh", "dp=2,pp=2", "--mode", "hybrid", "--stages", "2", "--cpus", "4"]) == cfg


def read_log(path):
    return [json.loads(line) for line in open(path)]


def test_a_run_writes_its_settings_beside_the_log_and_in_the_checkpoint(capsys, data_dir, tmp_path):
    argv = [*TINY, "--data-dir", str(data_dir), "--log-json", str(tmp_path / "log.jsonl"),
            "--checkpoint-dir", str(tmp_path / "ck"), "--lr", "0.1"]
    code, _, err = run_main(capsys, argv)
    assert code == 0, err
    beside, kept = tmp_path / "log.jsonl.config.toml", tmp_path / "ck" / "config.toml"
    assert beside.read_text() == kept.read_text() == config_file.dumps(parse(argv))
    assert parse(["--config", str(beside)]) == parse(argv)
    assert not list(tmp_path.glob(".*.tmp")) and not list((tmp_path / "ck").glob(".*.tmp"))


def test_a_run_from_its_written_settings_trains_the_same(capsys, data_dir, tmp_path):
    first = tmp_path / "first.jsonl"
    code, _, err = run_main(capsys, [*TINY, "--data-dir", str(data_dir), "--log-json", str(first), "--seed", "3"])
    assert code == 0, err
    again = tmp_path / "again.jsonl"
    code, _, err = run_main(capsys, ["--config", f"{first}.config.toml", "--log-json", str(again)])
    assert code == 0, err
    assert [r["train_loss"] for r in read_log(again)] == [r["train_loss"] for r in read_log(first)]


@pytest.mark.parametrize("outputs", [["--checkpoint-dir", "ck", "--log-json", "ck/config.toml"],
                                     ["--log-json", "log.jsonl", "--digests", "log.jsonl.config.toml"]],
                         ids=["log over the checkpoint's", "digests over the log's"])
def test_an_output_over_a_settings_file_is_refused(capsys, data_dir, tmp_path, monkeypatch, outputs):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, [*TINY, "--data-dir", str(data_dir), *outputs])
    assert code == 2 and len(err) == 1 and "where its run's settings go, is also" in err[0], err
