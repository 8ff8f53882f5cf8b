"""The shards a `model.safetensors.index.json` names lie in its directory.

An index naming `../../x/model.safetensors`, an absolute path, or a shard that links outside the
directory is refused with one line naming the entry, before any such file is opened. A Hugging Face
Hub cache snapshot, whose files link into the cache's own blobs, loads as it is.
"""

import json
import os

import pytest
import torch

from lazytrain.errors import DataError
from lazytrain.train import weights

from test_hf_model import save_model


def sharded(path):
    """A tiny sharded checkpoint; returns its weight map."""
    save_model(path, "qwen2", False, True)
    return json.loads((path / weights.INDEX_FILE).read_text())["weight_map"]


def move_shard(model_dir, weight_map, file, to):
    """The shard of the checkpoint's first tensor moved to `to`, and the index naming it `file`:
    every tensor of that shard placed there. Returns the first tensor's name."""
    name = sorted(weight_map)[0]
    shard = weight_map[name]
    (model_dir / shard).rename(to)
    index = json.loads((model_dir / weights.INDEX_FILE).read_text())
    index["weight_map"] = {n: file if f == shard else f for n, f in weight_map.items()}
    (model_dir / weights.INDEX_FILE).write_text(json.dumps(index))
    return min(n for n, f in weight_map.items() if f == shard)


@pytest.mark.parametrize("where", ["dotdot", "absolute", "link"])
def test_shard_outside_the_directory_is_refused(tmp_path, where):
    model_dir, elsewhere = tmp_path / "a" / "b" / "m", tmp_path / "x"
    weight_map = sharded(model_dir)
    elsewhere.mkdir()
    file = {"dotdot": "../../../x/model.safetensors", "absolute": str(elsewhere / "model.safetensors"),
            "link": "linked.safetensors"}[where]
    name = move_shard(model_dir, weight_map, file, elsewhere / "model.safetensors")
    if where == "link":
        (model_dir / "linked.safetensors").symlink_to(elsewhere / "model.safetensors")
    with pytest.raises(DataError) as err:
        weights.read(model_dir / weights.INDEX_FILE)
    message = str(err.value)
    assert "\n" not in message and f"places {name} in {file}, " in message
    assert {"dotdot": f"which is outside {model_dir}", "absolute": "an absolute path",
            "link": f"which links outside {model_dir}"}[where] in message


def test_system_file_is_never_opened(tmp_path, monkeypatch):
    model_dir = tmp_path / "m"
    weight_map = sharded(model_dir)
    index = json.loads((model_dir / weights.INDEX_FILE).read_text())
    index["weight_map"][sorted(weight_map)[0]] = "../../../../../../../../etc/passwd"
    (model_dir / weights.INDEX_FILE).write_text(json.dumps(index))
    opened = []
    monkeypatch.setattr(weights, "_read_header", lambda shard, origin: opened.append(shard))
    with pytest.raises(DataError, match="outside"):
        weights.read(model_dir / weights.INDEX_FILE)
    assert opened == []


def test_hub_cache_snapshot_loads(tmp_path):
    """models--org--name/snapshots/REV/ holds links to ../../blobs/HASH, as huggingface_hub writes."""
    from lazytrain.train.source import resolve

    made = tmp_path / "made"
    want = save_model(made, "qwen2", False, True).state_dict()
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, file in enumerate(sorted(made.iterdir())):
        (file).rename(blobs / f"blob{i}")
        (snapshot / file.name).symlink_to(os.path.join("..", "..", "blobs", f"blob{i}"))
    assert (snapshot / weights.INDEX_FILE).is_symlink()
    model, _ = resolve(snapshot, 2, 32, None).materialize()
    got = model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
