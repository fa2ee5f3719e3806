"""Which checkpoint the ranks of a job resume from (integrations/deepspeed/checkpoint.py,
_agree_on_tag), with each rank reading `latest` on its own node's disk: node-local checkpoints
whose nodes were left different by a kill between their commits, or by a node whose disk is
gone. Two ranks on two simulated nodes are two threads here, their all-gathers met through a
barrier (the real collectives run in tests/test_multinode.py)."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest

from offloadpp.integrations.deepspeed.checkpoint import _agree_on_tag
from offloadpp.runtime.checkpoint import CheckpointError


class _Ranks:
    """`world` ranks of one node each, whose all_gather_object meets in a barrier."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list = [None] * world

    def rank(self, r: int):
        ranks = self

        class DP:
            rank, world, node, local_rank, local_world = r, ranks.world, r, 0, 1

            def all_gather_object(self, obj) -> list:
                ranks.slots[r] = obj
                ranks.barrier.wait()
                out = list(ranks.slots)
                ranks.barrier.wait()  # (every rank has its copy before the next gather writes)
                return out

        return DP()


def _agree(dirs: list[str], tag=None) -> list:
    """_agree_on_tag on every rank, rank r reading dirs[r]: each one's tag or its error."""
    ranks = _Ranks(len(dirs))
    out: list = [None] * len(dirs)

    def run(r: int) -> None:
        try:
            out[r] = _agree_on_tag(ranks.rank(r), dirs[r], tag, True)
        except Exception as e:  # noqa: BLE001 - compared by the test
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(dirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _node_ckpt(save_dir, tag: str, rank: int, step: int, save_id: str) -> None:
    """What a node-local save leaves on node `rank` (of 2, one rank each) under save_dir/tag."""
    path = os.path.join(save_dir, tag)
    os.makedirs(os.path.join(path, f"rank{rank:05d}"))
    m = {"world_size": 2, "runtime": {"global_step": step}, "node_local": {"save_id": save_id, "node": rank}}
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(m, f)


def _latest(save_dir, tag: str) -> None:
    with open(os.path.join(save_dir, "latest"), "w") as f:
        f.write(tag)


def _two_nodes(tmp_path):
    n0, n1 = str(tmp_path / "n0"), str(tmp_path / "n1")
    for r, d in enumerate((n0, n1)):
        _node_ckpt(d, "step3", r, 3, "a")
    return n0, n1


def test_the_nodes_agree_and_a_node_without_the_new_tag_takes_the_ranks_back_to_the_newest_whole_one(
    tmp_path, caplog
):
    """A kill between the nodes' renames: node 0 has step6 in place and `latest` naming it,
    node 1 only .step6.partial and `latest` naming step3: both resume from step3, with a
    warning. Where both nodes hold both, the newer one."""
    n0, n1 = _two_nodes(tmp_path)
    _node_ckpt(n0, "step6", 0, 6, "b")
    _node_ckpt(n1, ".step6.partial", 1, 6, "b")
    _latest(n0, "step6")
    _latest(n1, "step3")
    with caplog.at_level(logging.WARNING, logger="offloadpp"):
        assert _agree([n0, n1]) == ["step3", "step3"]
    assert "the newest every rank holds" in caplog.text
    os.rename(
        os.path.join(n1, ".step6.partial"), os.path.join(n1, "step6")
    )  # (the rename came, not `latest`)
    assert _agree([n0, n1]) == ["step6", "step6"]


def test_a_node_without_the_checkpoint_is_named_with_its_missing_shard_folders(tmp_path):
    """Node 1's disk was replaced (no `latest`, no checkpoint): every rank raises naming rank 1,
    node 1 and the shard folder step3/rank00001; no rank resumes alone, none starts fresh."""
    n0, n1 = str(tmp_path / "n0"), str(tmp_path / "n1")
    _node_ckpt(n0, "step3", 0, 3, "a")
    _latest(n0, "step3")
    os.makedirs(n1)
    for e in _agree([n0, n1]):
        assert isinstance(e, CheckpointError), e
        msg = str(e)
        assert (
            "rank(s) [1] on node(s) [1] lack it" in msg and "step3/rank00001" in msg and "node-local" in msg
        )


def test_one_tag_from_two_saves_is_refused(tmp_path):
    """The same tag saved twice and the second save killed between the nodes' renames: node 0
    has the new one, node 1 the old one. Both are whole, neither is one save: refused."""
    n0, n1 = str(tmp_path / "n0"), str(tmp_path / "n1")
    _node_ckpt(n0, "t", 0, 6, "new")
    _node_ckpt(n1, "t", 1, 3, "old")
    for d in (n0, n1):
        _latest(d, "t")
    for e in _agree([n0, n1]):
        assert isinstance(e, CheckpointError) and "not one save on every node" in str(e), e


def test_no_checkpoint_on_any_node_is_a_fresh_start(tmp_path):
    os.makedirs(tmp_path / "n0")
    os.makedirs(tmp_path / "n1")
    assert _agree([str(tmp_path / "n0"), str(tmp_path / "n1")]) == [None, None]


@pytest.mark.parametrize("tag", ["step3", None])
def test_a_shared_folder_resolves_as_before(tmp_path, tag):
    """One folder every rank sees (not node-local): `latest` or the tag given, as one process."""
    d = str(tmp_path / "shared")
    for r in range(2):
        _node_ckpt(d, "step3", r, 3, "a") if r == 0 else os.makedirs(os.path.join(d, "step3", "rank00001"))
    _latest(d, "step3")
    assert _agree([d, d], tag) == ["step3", "step3"]


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_a_damaged_manifest_is_named_by_every_rank_not_taken_for_missing_shards(tmp_path, content):
    """A shared folder whose global manifest.json is not a JSON object, with both shard folders
    there: every rank names the file and the cause (was: "shard folders rank00000, rank00001
    are missing")."""
    d = str(tmp_path / "shared")
    _node_ckpt(d, "step3", 0, 3, "a")
    os.makedirs(os.path.join(d, "step3", "rank00001"))
    _latest(d, "step3")
    with open(os.path.join(d, "step3", "manifest.json"), "w") as f:
        f.write(content)
    why = (
        "is not valid JSON: Expecting property name" if content[0] == "{" else "is not a checkpoint manifest"
    )
    for e in _agree([d, d]):
        assert isinstance(e, CheckpointError), e
        msg = str(e)
        assert f"step3/manifest.json' {why}" in msg and "read by rank(s) [0, 1]" in msg, msg
        assert "checkpoint is damaged" in msg and "tag=" in msg and "missing" not in msg, msg
