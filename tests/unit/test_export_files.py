"""HF exports (checkpoint/hf_io.py SafetensorsShardWriter) are readable by others, as the process's umask allows:
safetensors wrote them for their owner alone (0600), which a team's shared file system could not read."""

import os
import stat

import torch

from dapo_mcore.checkpoint.hf_io import SafetensorsShardWriter


def test_exported_shards_take_the_umasks_mode_not_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        writer = SafetensorsShardWriter(tmp_path / "export")
        writer.add("model.embed_tokens.weight", torch.zeros(4, 2))
        writer.close()
    finally:
        os.umask(old)
    shards = sorted((tmp_path / "export").glob("*.safetensors"))
    assert shards and all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in shards), [
        oct(p.stat().st_mode) for p in shards
    ]
