"""Issue 32: hardening 0.3's new surface (masks, schedules, plans, files, messages).

One regression test per defect, named after it, with a variant or two so that
the fix is not shaped to one case (items 3, 18 and 19 live in test_schedule.py,
test_errors.py and test_bench_detection.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_folders import tiny_folder

import attnres
from attnres import Platform
from attnres.cli import main
from attnres.integrations import FolderBuildError, plan_folder

CPU = Platform.simulate("cpu")


# -- item 7: a duplicate key in a JSON file attnres reads ---------------------------------


def _duplicate(folder: Path, name: str, first: str, second: str) -> None:
    """Rewrite ``folder/name`` with the key ``first`` (its value) followed by ``second``."""
    path = folder / name
    text = path.read_text()
    assert text.startswith("{")
    path.write_text("{" + first + ", " + second + ", " + text[1:])


@pytest.mark.parametrize(
    ("name", "first", "second", "key"),
    [
        # the component dropped: its entry, then null
        ("model_index.json", '"vae": ["diffusers", "AutoencoderKL"]', '"vae": [null, null]', "vae"),
        # the folder built as the other class
        (
            "model_index.json",
            '"_class_name": "FluxPipeline"',
            '"_class_name": "StableDiffusionPipeline"',
            "_class_name",
        ),
        # a component's config: the value that counts depends on the reader
        ("vae/config.json", '"latent_channels": 4', '"latent_channels": 16', "latent_channels"),
    ],
    ids=["component-dropped", "class-changed", "config-value"],
)
def test_duplicate_json_key_in_a_model_folder_is_refused(
    tmp_path: Path, name: str, first: str, second: str, key: str
) -> None:
    folder = tiny_folder(tmp_path / "pipe")
    _duplicate(folder, name, first, second)
    with pytest.raises(FolderBuildError, match=f'the key "{key}" appears twice'):
        plan = plan_folder(folder, platform=CPU)
        assert plan.ok  # a plan that says ok here is the defect itself
        raise AssertionError(plan.errors)


def test_duplicate_json_key_is_refused_by_the_one_reader() -> None:
    from attnres._files import parse_json

    with pytest.raises(ValueError, match='the key "a" appears twice'):
        parse_json(b'{"a": 1, "b": {"a": 2}, "a": 3}')
    with pytest.raises(ValueError, match='the key "x" appears twice'):
        parse_json(b'[{"k": {"x": 1, "x": 1}}]')  # nested, even with equal values
    assert parse_json(b'{"a": {"a": 1}}') == {"a": {"a": 1}}  # one key per object is fine
