"""``specops train --config FILE``: the TOML file the chart and compose mount sets the
options, flags on the command line win, and a bad key or value is an error naming it."""

from __future__ import annotations

import argparse

import pytest

from specops import config_file
from specops.cli import main as cli


def _train_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    return parser, sub


def _parse(tmp_path, text: str, *flags: str) -> argparse.Namespace:
    path = tmp_path / "train.toml"
    path.write_text(text)
    parser, sub = _train_parser()
    sub.set_defaults(**config_file.load(path, sub, "train"))
    return parser.parse_args(["train", "--config", str(path), *flags])


def test_keys_set_options_and_flags_win(tmp_path):
    text = '[train]\nstream = "kafka://k:9092"\ninterval = 5\nlr = 2\nschedule = true\nloss = "jsd"\nbackend = "deepspeed"\n'
    args = _parse(tmp_path, text, "--interval", "7")
    assert args.stream == "kafka://k:9092" and args.schedule is True and args.loss == "jsd"
    assert args.interval == 7  # the flag, not the file
    assert args.lr == 2.0 and isinstance(args.lr, float)  # a TOML integer for a float option
    assert args.backend == "deepspeed" and args.zero_stage == 2  # untouched options keep their defaults


def test_top_level_keys_work_too(tmp_path):
    args = _parse(tmp_path, 'poll_records = 64\nmax_records = 10\nregistry = "none"\n')
    assert (args.poll_records, args.max_records, args.registry) == (64, 10, "none")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("intervall = 3\n", "intervall (in {path}): unknown key: not a `specops train` option"),
        ('interval = "often"\n', "interval (in {path}): invalid literal for int()"),
        ("interval = 8.0\n", "interval (in {path}): invalid literal for int()"),  # as --interval 8.0 would
        ('loss = "kl"\n', "loss (in {path}): Input should be 'fkl', 'rkl' or 'jsd'"),
        ("schedule = 1\n", "schedule (in {path}): Input should be a valid boolean"),
        ("interval = true\n", "interval (in {path}): expected a number, got True"),
        ("max_records = 0\n", "max_records (in {path}): expected an integer >= 1, got 0"),
        ("zero_stage = 3\n", "zero_stage (in {path}): Input should be 0, 1 or 2"),
        ("[train]\ninterval = 3\n[serve]\nport = 1\n", "--config {path}: keys ['serve'] are outside the [train] table"),
        ("interval = \n", "cannot read --config {path}"),
    ],
)
def test_bad_keys_and_values_name_the_key(tmp_path, text, message):
    path = tmp_path / "train.toml"
    path.write_text(text)
    _, sub = _train_parser()
    message = message.format(path=path)
    with pytest.raises(ValueError, match="--config.*train.toml") as err:
        config_file.load(path, sub, "train")
    assert message in str(err.value)


def test_cli_reports_a_bad_file_as_a_usage_error(tmp_path, capsys):
    path = tmp_path / "train.toml"
    path.write_text("intervall = 3\n")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--config", str(path)])
    assert exit_.value.code == 2 and "intervall (in " in capsys.readouterr().err
