"""Signed merge records and fragment snapshots on the wire
(docs/design.md, section 4, "Replicated global state").

A merge record travels as one safetensors blob: the merged outer gradient in the record codec (int4 by
default, ``NAME::PART`` as in contributions) and, as metadata, the record's fields as JSON, the signer's peer
id and an Ed25519 signature over ``domain | swarm | record JSON | sha256 of the tensors``, which binds it to
the swarm, fragment, round and parent hash. ``decode_record`` verifies it and checks the gradient's names,
shapes and finiteness; every replica steps with the same decoded values, so all land on one hash.

A snapshot carries, per fragment, the global tensors and outer momentum at a round, the head (round, hash,
contributors, weight) and the ids of the contributions its last rounds merged; ``decode_snapshot``
recomputes every fragment's hash and refuses a snapshot whose tensors do not land on it.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, replace

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dht.identity import Identity, verify
from node.swarm.trust.audit_wire import audit_doc, audit_fields
from protocol.codecs import Decoded, encode_tensors
from protocol.errors import ProtocolError, RejectCode
from protocol.hashing import tensors_hash
from protocol.messages import encoded_parts, finite_parts
from protocol.replica import MergeRecord
from protocol.schedule import RoundClock

_DOMAIN = "ddiloco/merge/v1"
_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.uint8)  # the codecs' parts and snapshots


MAX_WIRE_DIMS = 16  # dimensions of one tensor in a message


def _meta(raw: bytes) -> tuple[dict[str, torch.Tensor], dict]:
    try:
        tensors = st_load(raw)
        n = int.from_bytes(raw[:8], "little")
        meta = json.loads(raw[8 : 8 + n]).get("__metadata__") or {}
    except Exception as e:  # safetensors raises several types on garbage
        raise ProtocolError(
            RejectCode.MALFORMED, f"not a safetensors message: {type(e).__name__}: {str(e)[:200]}"
        ) from e
    # Before anything hashes them: tensors_hash cannot view float8/float4 tensors (numpy has no such dtype)
    # nor tensors of more than 64 dimensions (numpy's limit); no tensor of ours has more than a few.
    for k, t in tensors.items():
        if t.dtype not in _WIRE_DTYPES:
            raise ProtocolError(
                RejectCode.WRONG_SHAPE, f"tensor {k[:80]!r} has dtype {t.dtype}, not a wire dtype"
            )
        if t.dim() > MAX_WIRE_DIMS:
            raise ProtocolError(
                RejectCode.WRONG_SHAPE,
                f"tensor {k[:80]!r} has {t.dim()} dimensions, more than the {MAX_WIRE_DIMS} a message may hold",
            )
    return tensors, meta


def _record_doc(swarm: str, rec: MergeRecord) -> str:
    return json.dumps(
        {
            "swarm": swarm,
            "fragment": rec.fragment,
            "round": rec.round,
            "parent_hash": rec.parent_hash,
            "new_hash": rec.new_hash,
            "contributors": [list(c) for c in rec.contributors],
            "codec": rec.codec,
            "block": rec.block,
            "due": rec.due,
            "period": rec.period,
            **audit_doc(rec),
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def _signed_bytes(doc: str, grad_hash: str) -> bytes:
    return f"{_DOMAIN}|{doc}|{grad_hash}".encode()


def encode_record(swarm: str, rec: MergeRecord, ident: Identity) -> bytes:
    wire = rec.wire
    if wire is None:
        if rec.codec != "fp32":
            raise ValueError(f"a {rec.codec} record needs its encoded gradient")
        wire = encode_tensors({k: v.detach().cpu() for k, v in rec.grad.items()}, "fp32", rec.block)
    tensors = encoded_parts(wire)
    doc = _record_doc(swarm, rec)
    sig = ident.sign(_signed_bytes(doc, tensors_hash(tensors)))
    return st_save(tensors, metadata={"record": doc, "signer": ident.peer_id, "sig": sig.hex()})


@dataclass(frozen=True)
class SignedRecord:
    record: MergeRecord
    signer: str
    raw: bytes

    @property
    def total_weight(self) -> float:
        return float(sum(c[2] for c in self.record.contributors))

    @property
    def head(self) -> list:
        """The fragment head this record makes: [round, hash, contributors, total weight]."""
        r = self.record
        return [r.round, r.new_hash, len(r.contributors), self.total_weight]


def _short(x: object) -> str:
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


def _is_count(x: object) -> bool:
    return type(x) is int and x >= 0


def _is_weight(x: object) -> bool:
    return type(x) in (int, float) and math.isfinite(x) and x >= 0


def _contributor(c: object) -> tuple[str, str, float, int, int]:
    """One ``[learner, cid, weight, c_steps, c_tokens]`` entry with the types a merge writes."""
    if not (isinstance(c, list) and len(c) == 5):
        raise ValueError(f"contributor {_short(c)} is not [learner, cid, weight, c_steps, c_tokens]")
    a, b, w, cs, ct = c
    if not (isinstance(a, str) and isinstance(b, str) and _is_weight(w) and _is_count(cs) and _is_count(ct)):
        raise ValueError(f"contributor {_short(c)} has a field of the wrong type or sign")
    return a, b, float(w), cs, ct


def decode_record(raw: bytes, swarm: str, spec: dict[int, dict[str, tuple[int, ...]]]) -> SignedRecord:
    """Verify and decode a record; ``spec`` maps fragment -> tensor name -> shape. Raises ProtocolError."""
    tensors, meta = _meta(raw)
    try:
        doc_s, signer, sig = meta["record"], meta["signer"], bytes.fromhex(meta["sig"])
        doc = json.loads(doc_s)
        p, r = doc["fragment"], doc["round"]
        contributors = tuple(_contributor(c) for c in doc["contributors"])
        parent, new = doc["parent_hash"], doc["new_hash"]
        codec, block = doc["codec"], doc["block"]
        due, period = doc.get("due", 0.0), doc.get("period", 0.0)
        if not (isinstance(parent, str) and isinstance(new, str)):
            raise TypeError(f"hashes {_short(parent)}/{_short(new)} are not strings")
        if not (_is_weight(due) and _is_weight(period)):
            raise ValueError(
                f"schedule due={_short(due)} period={_short(period)} is not two finite times >= 0"
            )
    # RecursionError: JSON nested deeper than the parser's stack
    except (KeyError, ValueError, TypeError, RecursionError) as e:
        raise ProtocolError(
            RejectCode.MALFORMED, f"bad merge record metadata: {type(e).__name__}: {str(e)[:200]}"
        ) from e
    if type(p) is not int or type(r) is not int or r < 1:
        raise ProtocolError(RejectCode.MALFORMED, f"bad fragment/round {_short(p)}/{_short(r)}")
    if not math.isfinite(sum(c[2] for c in contributors)):  # each weight finite, their sum need not be
        raise ProtocolError(RejectCode.MALFORMED, "contributor weights sum to more than a float holds")
    if doc.get("swarm") != swarm:
        raise ProtocolError(
            RejectCode.BAD_SIGNATURE, f"record of swarm {_short(doc.get('swarm'))}, not {swarm!r}"
        )
    if not verify(str(signer), sig, _signed_bytes(doc_s, tensors_hash(tensors))):
        raise ProtocolError(
            RejectCode.BAD_SIGNATURE,
            f"record for fragment {_short(p)} round {_short(r)} not signed by {_short(signer)}",
        )
    if p not in spec:
        raise ProtocolError(RejectCode.WRONG_FRAGMENT, f"fragment {_short(p)} does not exist")
    grad = Decoded(finite_parts(tensors, codec, block, spec[p]))  # read a range at a time where applied
    rec = MergeRecord(
        p, r, parent, new, contributors, grad, codec, block, due=float(due), period=float(period)
    )
    rec = replace(rec, **audit_fields(doc, len(contributors)))
    return SignedRecord(rec, str(signer), raw)


def pack_list(items: list[bytes]) -> bytes:
    return struct.pack("<I", len(items)) + b"".join(struct.pack("<I", len(x)) + x for x in items)


def unpack_list(raw: bytes, max_items: int = 1024) -> list[bytes]:
    try:
        (n,) = struct.unpack_from("<I", raw, 0)
        if n > max_items:
            raise ValueError(f"{n} items exceed {max_items}")
        out, off = [], 4
        for _ in range(n):
            (k,) = struct.unpack_from("<I", raw, off)
            off += 4
            if off + k > len(raw):
                raise ValueError("truncated")
            out.append(raw[off : off + k])
            off += k
    except (struct.error, ValueError) as e:
        raise ProtocolError(RejectCode.MALFORMED, f"bad list frame: {e}") from e
    return out


def _request(raw: bytes, what: str) -> dict:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested deeper than the parser's stack
        raise ProtocolError(RejectCode.MALFORMED, f"bad {what}: {type(e).__name__}: {str(e)[:200]}") from e
    if not isinstance(doc, dict):
        raise ProtocolError(RejectCode.MALFORMED, f"bad {what}: a {type(doc).__name__}, not a JSON object")
    return doc


def parse_records_request(raw: bytes) -> tuple[int, int]:
    """Fragment and first round of a ``records`` request, ``{"fragment": p, "from": round}``."""
    doc = _request(raw, "records request")
    p, start = doc.get("fragment"), doc.get("from")
    if type(p) is not int or type(start) is not int:
        raise ProtocolError(
            RejectCode.MALFORMED, f"bad records request: fragment {_short(p)} / from {_short(start)} not ints"
        )
    return p, start


def parse_snapshot_request(raw: bytes, max_fragments: int = 1 << 16) -> list[int]:
    """The fragments a ``snapshot`` request asks for, ``{"fragments": [p, ...]}``."""
    frags = _request(raw, "snapshot request").get("fragments")
    if not (isinstance(frags, list) and len(frags) <= max_fragments and all(type(x) is int for x in frags)):
        raise ProtocolError(RejectCode.MALFORMED, f"bad snapshot request: fragments {_short(frags)}")
    return frags


def parse_route(raw: bytes) -> set[str]:
    """The peers a contribution's sender found dead, from its routing header ``{"dead": [peer, ...]}``."""
    dead = _request(raw, "routing header").get("dead")
    if not (isinstance(dead, list) and all(isinstance(x, str) for x in dead)):
        raise ProtocolError(RejectCode.MALFORMED, f"bad routing header: dead {_short(dead)}")
    return set(dead)


def unpack_signed_contribution(payload: bytes) -> tuple[set[str], bytes, bytes]:
    """A ``contribute`` request ``[routing, message, signature]``: dead peers, message, signature (b"" when
    the request carries none; ``verify_contribution`` then refuses it)."""
    items = unpack_list(payload, max_items=3)
    if len(items) not in (2, 3):
        raise ProtocolError(
            RejectCode.MALFORMED,
            f"contribute request of {len(items)} parts, expected [routing, message, signature]",
        )
    return parse_route(items[0]), items[1], items[2] if len(items) == 3 else b""


_CONTRIB_DOMAIN = "ddiloco/contribution/v1"


def _contribution_bytes(swarm: str, raw: bytes) -> bytes:
    return f"{_CONTRIB_DOMAIN}|{swarm}|{hashlib.sha256(raw).hexdigest()}".encode()


def sign_contribution(swarm: str, ident: Identity, raw: bytes) -> bytes:
    """The learner's Ed25519 signature over the whole contribution message, bound to the swarm. The message
    names the fragment, its base round and a contribution id; replays of a merged id are refused."""
    return ident.sign(_contribution_bytes(swarm, raw))


def verify_contribution(swarm: str, learner: str, raw: bytes, sig: bytes) -> None:
    if not sig:
        raise ProtocolError(RejectCode.BAD_SIGNATURE, f"contribution of {_short(learner)} is not signed")
    if not verify(learner, sig, _contribution_bytes(swarm, raw)):
        raise ProtocolError(
            RejectCode.BAD_SIGNATURE,
            f"contribution not signed by {_short(learner)} for swarm {_short(swarm)}",
        )


def parse_redirect(raw: bytes) -> str | None:
    """The peer a NOT_SYNCHRONISER reply suggests, ``{"try": peer | null}``; None when it names none."""
    who = _request(raw or b"{}", "redirect").get("try")
    if who is not None and not isinstance(who, str):
        raise ProtocolError(RejectCode.MALFORMED, f"bad redirect: try {_short(who)}")
    return who


@dataclass(frozen=True)
class FragmentState:
    fragment: int
    round: int
    hash: str
    n: int
    weight: float
    theta: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    tokens: int = 0  # tokens merged into this fragment so far (for status)
    clock: RoundClock | None = None  # when the round after it is due (protocol.schedule), if known
    merged: tuple[str, ...] = ()  # ids its last rounds merged: replay memory of the records it skips
    credited: tuple[str, ...] = ()  # the learners the donor's chain credits (``WorkBook.credited``)


SNAPSHOT_IDS_MAX = 2048  # merged ids one fragment's snapshot may name (the replay memory holds 65536)


def encode_snapshot(states: list[FragmentState]) -> bytes:
    tensors, heads, clocks, merged = {}, {}, {}, {}
    for s in states:
        for k, v in s.theta.items():
            tensors[f"{s.fragment}/theta/{k}"] = v.contiguous()
        for k, v in s.momentum.items():
            tensors[f"{s.fragment}/mom/{k}"] = v.contiguous()
        heads[str(s.fragment)] = [s.round, s.hash, s.n, s.weight, s.tokens]
        if s.clock is not None:
            clocks[str(s.fragment)] = [s.clock.first, s.clock.every]
        if s.merged:
            merged[str(s.fragment)] = list(s.merged)
    meta = {"heads": json.dumps(heads), "clocks": json.dumps(clocks), "merged": json.dumps(merged)}
    meta["credited"] = json.dumps(list(states[0].credited) if states else [])
    return st_save(tensors, metadata=meta)


def _snapshot_ids(merged: dict, p: int | str) -> tuple[str, ...]:
    """The merged contribution ids a snapshot names for fragment p (or its ``"credited"``): short strings."""
    ids = merged.get(str(p), [])
    ok = isinstance(ids, list) and len(ids) <= SNAPSHOT_IDS_MAX
    if not (ok and all(isinstance(c, str) and 0 < len(c) <= 256 for c in ids)):
        what = "credited learners" if p == "credited" else f"merged ids of fragment {p}"
        raise ValueError(f"{what} are not a list of at most {SNAPSHOT_IDS_MAX} short strings")
    return tuple(ids)


def _snapshot_clock(clocks: dict, p: int, round_: int) -> RoundClock | None:
    """The clock a snapshot names for fragment p (``[first, every]``), or None for a malformed entry (the
    learners then go by their steps until the next record). The receiver still bounds it
    (``protocol.schedule.sane_clock``, ``usable``)."""
    c = clocks.get(str(p))
    if not (isinstance(c, list) and len(c) == 2 and all(_is_weight(x) for x in c)) or not c[1] > 0:
        return None
    return RoundClock(round_ + 1, float(c[0]), float(c[1]))


def _snapshot_head(p: str, h: object) -> tuple[int, int, str, int, float, int]:
    """``"fragment": [round, hash, contributors, weight, tokens]`` with the types encode_snapshot writes."""
    if not (len(p) <= 9 and p.isascii() and p.isdigit() and str(int(p)) == p):
        raise ValueError(f"fragment key {_short(p)} is not a fragment number")
    if not (isinstance(h, list) and len(h) == 5):
        raise ValueError(f"head of fragment {p} {_short(h)} is not [round, hash, n, weight, tokens]")
    r, hash_, n, w, tok = h
    if not (_is_count(r) and isinstance(hash_, str) and _is_count(n) and _is_weight(w) and _is_count(tok)):
        raise ValueError(f"head of fragment {p} {_short(h)} has a field of the wrong type or sign")
    return int(p), r, hash_, n, float(w), tok


def decode_snapshot(raw: bytes, spec: dict[int, dict[str, tuple[int, ...]]]) -> list[FragmentState]:
    """Decode and verify: every fragment's tensors must match the spec and land on the hash it claims."""
    tensors, meta = _meta(raw)
    try:
        heads = json.loads(meta["heads"])
        if not isinstance(heads, dict):
            raise TypeError(f"heads is a {type(heads).__name__}, not an object")
        items = [_snapshot_head(p, h) for p, h in heads.items()]
        clocks = json.loads(meta.get("clocks", "{}"))
        if not isinstance(clocks, dict):
            clocks = {}
        merged = json.loads(meta.get("merged", "{}"))  # absent in a snapshot from an older node
        ids = {p: _snapshot_ids(merged if isinstance(merged, dict) else {}, p) for p, *_ in items}
        credited = _snapshot_ids({"credited": json.loads(meta.get("credited", "[]"))}, "credited")
    except (KeyError, ValueError, TypeError, RecursionError) as e:
        raise ProtocolError(
            RejectCode.MALFORMED, f"bad snapshot metadata: {type(e).__name__}: {str(e)[:200]}"
        ) from e
    out = []
    for p, r, h, n, w, tok in items:
        if p not in spec:
            raise ProtocolError(
                RejectCode.WRONG_FRAGMENT, f"snapshot names fragment {p}, which does not exist"
            )
        theta, mom = {}, {}
        for k, shape in spec[p].items():
            try:
                theta[k], mom[k] = tensors[f"{p}/theta/{k}"], tensors[f"{p}/mom/{k}"]
            except KeyError:
                raise ProtocolError(RejectCode.WRONG_SHAPE, f"snapshot of fragment {p} lacks {k}") from None
            for t in (theta[k], mom[k]):
                if t.dtype != torch.float32 or tuple(t.shape) != tuple(shape):
                    raise ProtocolError(
                        RejectCode.WRONG_SHAPE, f"snapshot {p}/{k}: {t.dtype} {tuple(t.shape)}"
                    )
                if not torch.isfinite(t).all():
                    raise ProtocolError(RejectCode.NOT_FINITE, f"snapshot {p}/{k} contains NaN or inf")
        got = tensors_hash(theta)
        if got != h:
            raise ProtocolError(
                RejectCode.MALFORMED, f"snapshot of fragment {p} lands on {got[:12]}, it claims {h[:12]}"
            )
        clock = _snapshot_clock(clocks, p, r)
        out.append(FragmentState(p, r, h, n, w, theta, mom, tok, clock, ids[p], credited))
    return out
