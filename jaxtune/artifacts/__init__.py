"""Content-addressed artifacts: cache keys, verified folders and the refs stages pass around.

May import: jaxtune.config, jaxtune.errors
"""

from jaxtune.errors import ArtifactMissing

from .keys import artifact_key, canonical_json, file_digest, plain_config, tree_digest, tree_files
from .ref import ArtifactRef
from .store import MANIFEST, ArtifactStore

__all__ = [
    "MANIFEST",
    "ArtifactMissing",
    "ArtifactRef",
    "ArtifactStore",
    "artifact_key",
    "canonical_json",
    "file_digest",
    "plain_config",
    "tree_digest",
    "tree_files",
]
