"""Every way a KV transfer can fail, one exception class each.

The decode worker falls back to recomputing the prompt on any ``KVTransferError``; the
``reason`` of each class is a short, stable label for the fallback counter in ``/metrics``.
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Base of all transfer failures."""

    reason = "error"


class PeerUnreachable(KVTransferError):
    """The peer's KV endpoint could not be reached (refused, no route, connect timeout)."""

    reason = "unreachable"


class ConnectionDropped(KVTransferError):
    """The connection closed or reset before the transfer completed."""

    reason = "dropped"


class ChecksumMismatch(KVTransferError):
    """A block's bytes did not match its checksum (or its hash was not the one planned)."""

    reason = "checksum"


class AuthenticationError(KVTransferError):
    """The peer did not prove knowledge of the cluster secret (or refused ours)."""

    reason = "auth"


class LeaseNotFound(KVTransferError):
    """The prefill worker holds no live lease for the request: unknown, released or expired."""

    reason = "lease"


class TransferTimeout(KVTransferError, TimeoutError):
    """The peer did not answer within the configured timeout."""

    reason = "timeout"


class ProtocolError(KVTransferError):
    """The peer sent a frame that breaks the protocol (bad magic, version, sizes, order)."""

    reason = "protocol"


class RemoteError(KVTransferError):
    """The peer answered with an error frame that maps to no more specific class."""

    reason = "remote"


class IncompatibleKV(KVTransferError, ValueError):
    """The remote KV was computed for another model, dtype, block size or block layout."""

    reason = "incompatible"
