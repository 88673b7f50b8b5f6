"""An embedding model's pooling, from its sentence-transformers files (pure: the caller reads them).

A sentence-transformers repository lists its modules in `modules.json` (Transformer, then Pooling,
then Normalize, in order); the Pooling module's `config.json` says how token states become one
vector, in one of two formats: the older `pooling_mode_<mode>_token(s)` flags, or `pooling_mode`
(sentence-transformers 6). exo serves the modes embedding models use: mean, CLS and last token.

A cross-encoder (a reranker) has no Pooling module: its `config.json` names a sequence classifier
with one label, and it is served as an embedder whose spec says `rerank` (its activation).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from exo.core.types import EmbeddingSpec, Pooling, ScoreActivation

_LEGACY_FLAGS: dict[str, Pooling] = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                                     "pooling_mode_lasttoken": "lasttoken"}
_UNSERVED_FLAGS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ACTIVATIONS: dict[str, ScoreActivation] = {"Sigmoid": "sigmoid", "Identity": "identity"}  # torch.nn's class names


class EmbeddingFilesError(ValueError):
    """The files say the model embeds, in a way exo cannot serve or read; the message says which."""


def pooling_module_path(modules_json: str) -> tuple[str, bool] | None:
    """(the Pooling module's folder, whether a Normalize module follows) from `modules.json`; None
    when it lists no Pooling module (not an embedding model)."""
    try:
        modules = json.loads(modules_json)
    except json.JSONDecodeError as error:
        raise EmbeddingFilesError(f"modules.json is not JSON: {error}") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise EmbeddingFilesError("modules.json must be a list of modules")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if "Pooling" not in kinds:
        return None
    path = modules[kinds.index("Pooling")].get("path", "")
    if not isinstance(path, str) or ".." in path.split("/") or path.startswith("/"):
        raise EmbeddingFilesError(f"the Pooling module's path {path!r} is not a folder of the model")
    return path, "Normalize" in kinds


def embedding_spec(pooling_config: str, normalize: bool) -> EmbeddingSpec:
    """The spec from the Pooling module's `config.json` (either format)."""
    try:
        config: Any = json.loads(pooling_config)
    except json.JSONDecodeError as error:
        raise EmbeddingFilesError(f"the pooling config is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise EmbeddingFilesError("the pooling config must be a JSON object")
    return EmbeddingSpec(pooling=_mode(config), normalize=normalize)


def _mode(config: dict[str, Any]) -> Pooling:
    if "pooling_mode" in config:  # sentence-transformers 6: a name, or a list of names (concatenated)
        given = config["pooling_mode"]
        modes = given if isinstance(given, list) else [given]
    else:
        modes = [name for flag, name in _LEGACY_FLAGS.items() if config.get(flag)]
        modes += [flag for flag in _UNSERVED_FLAGS if config.get(flag)]
        modes = modes or ["mean"]  # sentence-transformers' own default when no flag is set
    if len(modes) != 1 or modes[0] not in ("mean", "cls", "lasttoken"):
        raise EmbeddingFilesError(f"pooling {modes} is not served: exo pools by mean, cls or lasttoken, one of them")
    served: dict[str, Pooling] = {"mean": "mean", "cls": "cls", "lasttoken": "lasttoken"}
    return served[modes[0]]


def cross_encoder_spec(config_text: str) -> EmbeddingSpec | None:
    """A reranker's spec from its `config.json`, if it is a cross-encoder (a *ForSequenceClassification
    with one label, as sentence-transformers' CrossEncoder saves it); None if not. The activation is
    CrossEncoder's own default: the one its config names (`sentence_transformers.activation_fn`, or
    `sbert_ce_default_activation_function` before v4), else Sigmoid for one label."""
    try:
        config: Any = json.loads(config_text)
    except json.JSONDecodeError:
        return None  # not a model's config: whoever reads it next says so
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list) or not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return None
    labels = config.get("num_labels", len(config.get("id2label") or {"0": ""}))
    if labels != 1:
        raise EmbeddingFilesError(f"a sequence classifier with {labels} labels is not served: a reranker has one")
    if config.get("model_type") != "bert":
        raise EmbeddingFilesError(f"cross-encoders are served for BERT (model_type 'bert'), not {config.get('model_type')!r}")
    settings = config.get("sentence_transformers")
    named = (settings.get("activation_fn") if isinstance(settings, dict) else None) \
        or config.get("sbert_ce_default_activation_function") or "Sigmoid"
    activation = str(named).rsplit(".", 1)[-1]
    if activation not in _ACTIVATIONS:
        raise EmbeddingFilesError(f"the cross-encoder's activation {named!r} is not served: exo applies Sigmoid or Identity")
    return EmbeddingSpec(pooling="cls", normalize=False, rerank=_ACTIVATIONS[activation])


def embedding_of(read: Callable[[str], str | None]) -> EmbeddingSpec | None:
    """The model's pooling, if its sentence-transformers files say it embeds (or its config, that it
    reranks); None if not. `read` gives a file's text by its path in the model, or None where there
    is no such file (a Hub listing, a folder: the caller's I/O, not this module's)."""
    modules = read("modules.json")
    found = pooling_module_path(modules) if modules is not None else None
    if found is None:
        config_text = read("config.json")
        return cross_encoder_spec(config_text) if config_text is not None else None
    folder, normalize = found
    config = read(f"{folder}/config.json" if folder else "config.json")
    if config is None:
        raise EmbeddingFilesError(f"modules.json names a Pooling module at {folder!r}, which has no config.json")
    return embedding_spec(config, normalize)
