"""Quantized all-reduce bodies shared by gloo (spawned ranks) and mpi (mpirun), run with the sparse cases.

Every rank can build every rank's input (generators seeded by seed and rank),
so each checks its results against a single-process reference made with the
same :class:`~sparsecomm.quantized.Quantizer`: bit for bit, since the owner
averages the decoded contributions in rank order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import sparsecomm.distributed as dist
from bindings.stats import ring_bytes
from sparsecomm.quantized import QUANT_BITS, Quantizer, quantized_all_reduce
from tests.common.bad_input_cases import _expect


def _input(seed: int, rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + n)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g)


def _reference(
    q: Quantizer, inputs: list[torch.Tensor], residuals: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(result, each rank's error, each owner's new residual) of one call."""
    ws = len(inputs)
    chunk = inputs[0].numel() // ws
    result, new_res = [], []
    decoded = [torch.cat([q.encode(x[c * chunk : (c + 1) * chunk])[1] for c in range(ws)]) for x in inputs]
    for c in range(ws):
        avg = torch.zeros(chunk)
        for r in range(ws):
            avg += decoded[r][c * chunk : (c + 1) * chunk]
        avg /= ws
        avg += residuals[c]
        out = q.encode(avg)[1]
        result.append(out)
        new_res.append(avg - out)
    return torch.cat(result), [x - d for x, d in zip(inputs, decoded, strict=True)], new_res


def case_quantized_matches_reference(rank: int, ws: int) -> int:
    """The same result on every rank, equal bit for bit to the reference; errors and residuals too."""
    comm = dist.get_communicator()
    checks = 0
    for bits in QUANT_BITS:
        q = Quantizer(bits=bits)
        for chunk in (1, 70, 1000):
            n = chunk * ws
            residuals = [torch.zeros(chunk) for _ in range(ws)]
            mine = residuals[rank].clone()
            for round_ in range(2):  # the second round starts from a residual that is not zero
                inputs = [_input(10 * bits + round_, r, n) for r in range(ws)]
                want, errors, new_res = _reference(q, inputs, residuals)
                values = inputs[rank].clone()
                error = quantized_all_reduce(comm, values, q, residual=mine)
                assert torch.equal(values, want), (bits, chunk, round_, (values - want).abs().max())
                assert torch.equal(error, errors[rank]), (bits, chunk, round_)
                assert torch.equal(mine, new_res[rank]), (bits, chunk, round_)
                # error feedback loses nothing: what went in comes out, or stays in an error or a residual
                before = torch.stack(inputs).mean(0) + torch.cat(residuals)
                after = values + torch.stack(errors).mean(0) + torch.cat(new_res)
                torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
                residuals = new_res
                checks += 4
            no_res = _input(99, rank, n)
            quantized_all_reduce(comm, no_res, q)  # without a residual: the same average, nothing kept
            want, _, _ = _reference(q, [_input(99, r, n) for r in range(ws)], [torch.zeros(chunk)] * ws)
            assert torch.equal(no_res, want)
            checks += 1
    return checks


def case_quantized_byte_accounting(rank: int, ws: int) -> int:
    """Per call a rank sends its ws - 1 foreign chunks and all-gathers its own: 2 (ws - 1) encoded chunks."""
    stats = dist.get_stats()
    comm = dist.get_communicator()
    checks = 0
    for bits in QUANT_BITS:
        q = Quantizer(bits=bits)
        chunk = 1003
        stats.reset()
        quantized_all_reduce(comm, _input(1, rank, chunk * ws), q)
        nbytes = q.encoded_bytes(chunk)
        assert nbytes == 16 * (2 + 8 * bits)  # 16 blocks of 64 values: a bfloat16 scale and the codes
        sent = stats.get("quantized_all_reduce").bytes_sent
        assert sent == (ws - 1) * nbytes + ring_bytes("all_gather", nbytes, ws)[0], (bits, sent)
        assert stats.get("all_reduce").calls == 0 and stats.get("send").calls == 0  # all inside the scope
        checks += 2
    return checks


def case_quantized_bad_input(rank: int, ws: int) -> int:
    """Bad input: the same clear error on every rank before any communication, nothing written."""
    comm = dist.get_communicator()
    q = Quantizer(bits=4)
    x = torch.ones(8 * ws)
    cases: list[tuple[type[BaseException], str, Callable[[], Any]]] = [
        (TypeError, "quantizer", lambda: quantized_all_reduce(comm, x, 4)),  # type: ignore[arg-type]
        (TypeError, "values", lambda: quantized_all_reduce(comm, [1.0] * ws, q)),  # type: ignore[arg-type]
        (ValueError, "float32", lambda: quantized_all_reduce(comm, x.double(), q)),
        (ValueError, "1-D", lambda: quantized_all_reduce(comm, x.view(ws, 8), q)),
        (ValueError, "residual", lambda: quantized_all_reduce(comm, x, q, residual=torch.zeros(9))),
        (TypeError, "residual", lambda: quantized_all_reduce(comm, x, q, residual=[0.0] * 8)),  # type: ignore[arg-type]
    ]
    if ws > 1:
        cases.append((ValueError, "multiple", lambda: quantized_all_reduce(comm, torch.ones(8 * ws + 1), q)))
    for exc, needle, fn in cases:
        _expect(exc, needle, fn)
    assert torch.equal(x, torch.ones(8 * ws))
    y = torch.full((8 * ws,), float(rank + 1))
    quantized_all_reduce(comm, y, Quantizer(bits=8))  # still in step with each other
    torch.testing.assert_close(y, torch.full((8 * ws,), (ws + 1) / 2), rtol=0, atol=0.01)
    return len(cases)


QUANTIZED_CASES: dict[str, Callable[[int, int], int]] = {
    "quantized_matches_reference": case_quantized_matches_reference,
    "quantized_byte_accounting": case_quantized_byte_accounting,
    "quantized_bad_input": case_quantized_bad_input,
}
