"""Weight sync: gather the actor's shards, rename them to HF, bucket them and push them to the engines."""

from dapo_mcore.weight_sync.export import WeightExporter

__all__ = ["WeightExporter"]
