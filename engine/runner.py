"""ModelRunner: one forward pass of the HF model over a step's mixed prefill/decode batch.

Only the tokens that lack KV are fed to the model; the prefix is read from the paged pool by
``engine.attention``. Logits are computed only for rows that sample this step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from cache.kv_storage import KVStorage
from engine import attention
from engine.attention import CHUNK_MAX_CONTEXT, KERNEL_MAX_ROWS, AttentionMetadata, PagedRows, PrefillSpan
from engine.fast_decoder import FastDecoder
from engine.kernels import NativeOps
from engine.packing import panel_ops, use_panel_kernel


class ModelRunner:
    """Owns the model's forward pass over a ``KVStorage``; stateless between steps."""

    def __init__(self, model: Any, storage: KVStorage, native: NativeOps | None = None,
                 fast_decoder: bool = True) -> None:
        """``native``: the native CPU ops (engine.kernels): the paged-attention kernel for decodes
        and short prefill chunks, fused element-wise steps; None runs PyTorch's ops only.
        ``fast_decoder``: run Llama-family models through `FastDecoder` rather than transformers'
        modules (same arithmetic, fewer ops)."""
        self.model = model
        self.paged_kernel: Callable[..., torch.Tensor] | None = None
        self.chunk_kernel: Callable[..., torch.Tensor] | None = None
        self.storage = storage
        self.block_size = storage.block_size
        self.device = storage.device
        transformers_model = hasattr(model, "set_attn_implementation")
        if transformers_model:
            model.set_attn_implementation(attention.register())
        elif not fast_decoder:
            raise ValueError("a model loaded by engine.direct_model runs only through the fast decoder; "
                             "load it with transformers (load_model(..., direct=False)) to run its modules")
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.fast: FastDecoder | None = None
        # the fast decoder's last layer computes only the rows that sample (past writing its K/V)
        self.trim_last_layer = True
        if fast_decoder and FastDecoder.unsupported(model) is None:
            self.fast = FastDecoder(model, None)
        self.use_native(native)

    def use_native(self, native: NativeOps | None) -> None:
        """Run every part of a step on ``native`` (None: on PyTorch's ops alone), all switched
        together: the attention kernels, the fast decoder's fused steps and the packed layers'
        matmul. The engine switches between two steps, on the thread that runs them, so a step
        runs wholly on one set of ops (engine/loop.py). Packing the panels takes a moment. A
        bfloat16 model takes all of them, the panels in bfloat16 where the CPU has AVX512-BF16 or AVX2."""
        if self.storage.device.type != "cpu" or self.storage.dtype not in (torch.float32, torch.bfloat16):
            native = None  # the native ops are CPU kernels
        # decodes and short chunks, over a float32 or a bfloat16 pool
        self.paged_kernel = native.paged_attention if native is not None else None
        # many-row prefill chunks; head sizes the kernel's tiles take (a multiple of 8)
        self.chunk_kernel = native.chunk_attention if native is not None and \
            self.storage.keys(0).shape[-1] % 8 == 0 else None
        if self.fast is not None:
            self.fast.use_native(native)
        if native is not None:
            f32 = panel_ops(native, torch.float32)
            assert f32 is not None
            use_panel_kernel(self.modules(), *f32, bf16=panel_ops(native, torch.bfloat16))
        else:
            use_panel_kernel(self.modules(), None)

    def modules(self) -> list[torch.nn.Module]:
        """Every module a step runs, once each: the model's and the fast decoder's layers."""
        found = {id(m): m for m in self.model.modules()}
        for module in self.fast.modules() if self.fast is not None else []:
            found.setdefault(id(module), module)
        return list(found.values())

    @torch.inference_mode()
    def execute(
        self,
        token_ids: Sequence[Sequence[int]],
        starts: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        sample_rows: Sequence[int],
    ) -> torch.Tensor:
        """Run one step and return float32 logits [len(sample_rows), vocab].

        Row i computes ``token_ids[i]`` at positions ``starts[i]...`` using ``block_tables[i]``;
        ``sample_rows`` lists the rows whose last token's logits are wanted. Single-token rows must
        come before multi-token rows.
        """
        meta, input_ids, positions, last_index = self._prepare(token_ids, starts, block_tables)
        keep = [last_index[r] for r in sample_rows]
        if self.trim_last_layer and self.fast is not None and self.paged_kernel is not None \
                and len(keep) < len(input_ids[0]):
            # the last layer past its K/V only for the sampled rows (none in a prompt's middle
            # chunk): 1/num_layers of a prefill's o_proj, MLP and attention saved
            hidden = self.fast(input_ids[0], positions[0], meta,
                               keep=self._sampled_rows(token_ids, starts, block_tables, sample_rows, keep, meta))
            if not keep:
                return hidden.new_empty((0, 0), dtype=torch.float32)
            return self.lm_head(hidden).float()
        if self.fast is not None:
            hidden = self.fast(input_ids[0], positions[0], meta)
        else:
            hidden = self.decoder(
                input_ids=input_ids, position_ids=positions, use_cache=False, kvgate=meta
            ).last_hidden_state[0]
        if not sample_rows:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        rows = torch.tensor(keep, device=self.device)
        return self.lm_head(hidden.index_select(0, rows)).float()

    def _prepare(
        self, token_ids: Sequence[Sequence[int]], starts: Sequence[int], block_tables: Sequence[Sequence[int]]
    ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, list[int]]:
        bs = self.block_size
        flat_tokens: list[int] = []
        flat_pos: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        last_index: list[int] = []
        decode_tables: list[Sequence[int]] = []
        decode_lens: list[int] = []
        prefills: list[tuple[int, int, int, Sequence[int]]] = []
        kernel_spans: list[tuple[int, int, int, Sequence[int]]] = []  # (offset, n, ctx, blocks)
        chunk_spans: list[tuple[int, int, int, Sequence[int]]] = []
        for toks, start, table in zip(token_ids, starts, block_tables, strict=True):
            n = len(toks)
            offset = len(flat_tokens)
            flat_tokens.extend(toks)
            positions = range(start, start + n)
            flat_pos.extend(positions)
            slot_blocks.extend(table[p // bs] for p in positions)
            slot_offsets.extend(p % bs for p in positions)
            last_index.append(offset + n - 1)
            blocks = table[: -(-(start + n) // bs)]
            if self.paged_kernel is not None and n <= KERNEL_MAX_ROWS:
                kernel_spans.append((offset, n, start + n, blocks))
            elif n == 1:
                assert not prefills, "decode rows must precede prefill rows"
                decode_tables.append(blocks)
                decode_lens.append(start + 1)
            elif self.chunk_kernel is not None and start + n <= CHUNK_MAX_CONTEXT:
                chunk_spans.append((offset, n, start + n, blocks))
            else:
                prefills.append((offset, n, start, blocks))
        dev = self.device
        meta = AttentionMetadata(
            storage=self.storage,
            slot_blocks=torch.tensor(slot_blocks, device=dev),
            slot_offsets=torch.tensor(slot_offsets, device=dev),
        )
        if kernel_spans:
            meta.paged.append(self._paged_rows(kernel_spans, self._few_rows_op()))
        if chunk_spans:
            assert self.chunk_kernel is not None
            chunk = self.chunk_kernel
            meta.paged.append(self._paged_rows(chunk_spans, lambda q, *args: chunk(
                q if q.stride(1) == q.shape[2] and q.stride(2) == 1 else q.contiguous(),  # any row stride
                *args, attention.CHUNK_ROW_TILES)))
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            padded = [list(t) + [0] * (width - len(t)) for t in decode_tables]
            meta.num_decodes = len(decode_tables)
            meta.decode_tables = torch.tensor(padded, device=dev)
            lens = torch.tensor(decode_lens, device=dev)
            meta.decode_mask = (torch.arange(width * bs, device=dev)[None, :] < lens[:, None])[:, None, None, :]
        for offset, n, start, table in prefills:
            ctx = start + n
            mask = None
            if start > 0:  # additive (0 / -inf), built once for every layer: SDPA turns a bool
                # mask into this form itself, again on every layer
                q_pos = torch.arange(start, ctx, device=dev)
                hidden = torch.arange(ctx, device=dev)[None, :] > q_pos[:, None]
                mask = torch.zeros(hidden.shape, dtype=self.storage.dtype, device=dev)
                mask = mask.masked_fill_(hidden, float("-inf"))[None, None]
            meta.prefills.append(PrefillSpan(
                start=offset, end=offset + n, ctx_len=ctx,
                block_ids=torch.tensor(list(table), device=dev), mask=mask))
        input_ids = torch.tensor([flat_tokens], device=dev)
        positions_t = torch.tensor([flat_pos], device=dev)
        return meta, input_ids, positions_t, last_index

    def _sampled_rows(self, token_ids: Sequence[Sequence[int]], starts: Sequence[int],
                      block_tables: Sequence[Sequence[int]], sample_rows: Sequence[int], keep: list[int],
                      meta: AttentionMetadata) -> tuple[torch.Tensor, AttentionMetadata]:
        """The flat rows that sample and the attention metadata of those rows alone: each its
        sequence's last token, one row over its whole context, by the few-row kernel."""
        rows_meta = AttentionMetadata(storage=self.storage, slot_blocks=meta.slot_blocks, slot_offsets=meta.slot_offsets)
        spans = []
        for j, r in enumerate(sample_rows):
            ctx = starts[r] + len(token_ids[r])
            spans.append((j, 1, ctx, block_tables[r][: -(-ctx // self.block_size)]))
        if spans:
            rows_meta.paged.append(self._paged_rows(spans, self._few_rows_op()))
        return torch.tensor(keep, dtype=torch.long, device=self.device), rows_meta

    def _few_rows_op(self) -> Callable[..., torch.Tensor]:
        """The few-row kernel as a `PagedRows.op` (it takes rows at any stride, each row's heads
        contiguous: the fast decoder's view of its fused q/k/v projection as it is)."""
        paged = self.paged_kernel
        assert paged is not None

        def op(q: torch.Tensor, *args: Any) -> torch.Tensor:
            if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
                q = q.contiguous()
            return paged(q, *args, attention.KERNEL_SPLIT_TOKENS)
        return op

    def _paged_rows(self, spans: list[tuple[int, int, int, Sequence[int]]],
                    op: Callable[..., torch.Tensor]) -> PagedRows:
        dev = self.device
        width = max(len(blocks) for _, _, _, blocks in spans)
        q_start = [0]
        rows: list[int] = []
        for offset, n, _, _ in spans:
            q_start.append(q_start[-1] + n)
            rows.extend(range(offset, offset + n))
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        return PagedRows(
            op=op, num_rows=len(rows), first=rows[0],
            tables=torch.tensor([list(b) + [0] * (width - len(b)) for _, _, _, b in spans], dtype=torch.long, device=dev),
            q_start=torch.tensor(q_start, dtype=torch.long, device=dev),
            ctx_lens=torch.tensor([ctx for _, _, ctx, _ in spans], dtype=torch.long, device=dev),
            index=None if consecutive else torch.tensor(rows, dtype=torch.long, device=dev))
