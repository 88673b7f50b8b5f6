"""The tokenizers the API node counts tokens with (exo/api/tokenize.py), no runner needed: each
model's tokenizer and chat template, loaded with mlx-lm's own loader from its support files, found
or fetched once (exo/models/tokenizer_files.py) from where the worker gets a model: a local copy,
a peer that has it (exo/bus/peers/model_share.py), else the Hub. The last few used stay loaded.

A tokenizer that cannot be had is a 424 naming why (offline, not on the Hub, gated, no
tokenizer), or a 503 while the Hub cannot be reached; nothing is remembered of a failure."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from exo.api.context import ApiContext
from exo.api.errors import ApiError
from exo.bus.peers.model_share import IN_FLIGHT, PeerError, fetch_from_peer, peer_manifest
from exo.core.ids import NodeId
from exo.core.types import ModelCard
from exo.models.dirs import write_manifest
from exo.models.files import Manifest, missing, with_verified
from exo.models.tokenizer_files import cache_dir_of, fetch_from_hub_into, find_tokenizer, start_cache, support_files
from exo.models.transfer import Corrupt, DownloadError, PartialFile

log = logging.getLogger(__name__)

LOADED = 4  # tokenizers kept loaded: a large one holds tens of MB
_TRANSIENT = {"network", "rate_limited"}  # Hub failures worth trying again soon: 503, not 424
_Key = tuple[str, str, str]


@dataclass(frozen=True)
class ModelTokenizer:
    wrapper: Any  # mlx-lm's TokenizerWrapper, as the model's runner loads it
    vocab_size: int  # token ids it knows, added tokens included: 0 .. vocab_size - 1


class Tokenizers:
    def __init__(self, ctx: ApiContext, capacity: int = LOADED) -> None:
        self._ctx = ctx
        self._capacity = capacity
        self._loaded: OrderedDict[_Key, ModelTokenizer] = OrderedDict()
        self._loading: dict[_Key, asyncio.Lock] = {}  # one fetch and load per model at a time
        self._slots = asyncio.Semaphore(IN_FLIGHT)  # chunk requests to peers in flight

    async def of(self, card: ModelCard) -> ModelTokenizer:
        key = (card.model_id, card.revision, card.path)
        tokenizer = self._loaded.get(key)
        if tokenizer is None:
            async with self._loading.setdefault(key, asyncio.Lock()):
                tokenizer = self._loaded.get(key)  # loaded while this request waited
                if tokenizer is None:
                    tokenizer = await asyncio.to_thread(_load, card, await self._directory(card))
            self._loading.pop(key, None)
        self._loaded[key] = tokenizer
        self._loaded.move_to_end(key)
        while len(self._loaded) > self._capacity:
            self._loaded.popitem(last=False)
        return tokenizer

    async def _directory(self, card: ModelCard) -> Path:
        ctx = self._ctx
        cache = cache_dir_of(ctx.data_dir, card)
        found = await asyncio.to_thread(find_tokenizer, card, ctx.model_dirs, cache)
        if found is not None:
            return found
        if ctx.models.offline:
            raise _unavailable(card, DownloadError("offline", "offline mode: it is in no model directory of this node"))
        if ctx.models.model_sharing and await self._from_peers(card, cache):
            return cache
        try:
            return await asyncio.to_thread(fetch_from_hub_into, cache, card, None, threading.Event())
        except DownloadError as error:
            raise _unavailable(card, error) from None

    async def _from_peers(self, card: ModelCard, cache: Path) -> bool:
        """The support files from the first node whose copy of the model is complete."""
        for peer in _peers_with(self._ctx, card):
            try:
                source = await peer_manifest(self._ctx.nc, peer, card.model_id)
                if source.repo_id != card.source_repo or card.revision not in (source.revision, source.commit):
                    continue
                await self._copy_from(peer, card, cache, source)
                return True
            except PeerError as error:
                log.info("tokenizer of %s: peer %s cannot serve it (%s)", card.model_id, peer, error)
        return False

    async def _copy_from(self, peer: NodeId, card: ModelCard, cache: Path, source: Manifest) -> None:
        manifest = await asyncio.to_thread(start_cache, cache, source)
        needed = support_files(manifest)
        if not set(needed) <= set(source.verified):
            raise PeerError(f"node {peer} has not verified every support file of {card.model_id}")
        for path in missing(manifest, needed):
            partial = PartialFile(cache, path, manifest.files[path])
            await asyncio.to_thread(partial.open)

            async def write(data: bytes, into: PartialFile = partial) -> None:
                await asyncio.to_thread(into.write, data)

            try:
                await fetch_from_peer(self._ctx.nc, peer, card.model_id, path, partial.size, partial.meta.size, write,
                                      self._slots)
                meta = await asyncio.to_thread(partial.finish)
            except Corrupt as corrupt:
                raise PeerError(f"the copy from node {peer} failed verification: {corrupt}") from None
            finally:
                partial.close()
            manifest = with_verified(manifest, path, meta)
            await asyncio.to_thread(write_manifest, cache, manifest)


TOKENIZERS_KEY = web.AppKey("exo_tokenizers", Tokenizers)  # the app's, set by build_app


def _peers_with(ctx: ApiContext, card: ModelCard) -> list[NodeId]:
    """Other nodes whose copy of the model is complete, in a stable order (as the worker's downloads ask)."""
    downloads = ctx.view.state.downloads
    return sorted(n for n, models in downloads.items()
                  if n != ctx.node_id and (d := models.get(card.model_id)) is not None and d.status == "completed")


def _load(card: ModelCard, directory: Path) -> ModelTokenizer:
    # Imported here: mlx and transformers load only on an API node that counts tokens.
    from mlx_lm.utils import load_tokenizer

    try:
        config = json.loads((directory / "config.json").read_text())
        wrapper = load_tokenizer(directory, eos_token_ids=config.get("eos_token_id"))
        return ModelTokenizer(wrapper=wrapper, vocab_size=len(wrapper.get_vocab()))
    except Exception as error:  # noqa: BLE001 - any failure of a repository's files is the model's
        raise ApiError(424, f"the tokenizer of {card.model_id!r} cannot be loaded from {directory}: "
                            f"{type(error).__name__}: {error}", param="model", code="tokenizer_unavailable") from None


def _unavailable(card: ModelCard, error: DownloadError) -> ApiError:
    status = 503 if error.code in _TRANSIENT else 424
    return ApiError(status, f"the tokenizer of {card.model_id!r} cannot be had: {error.reason}", param="model",
                    code="tokenizer_unavailable", headers={"Retry-After": "5"} if status == 503 else None)
