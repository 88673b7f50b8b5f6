"""A streaming FLAC encoder for 16-bit mono PCM, in pure Python: exo ships no ffmpeg or libFLAC.

Every frame holds its block's samples verbatim (FLAC's VERBATIM subframe: no prediction, so about
the size of the WAV), which any FLAC decoder reads; what it buys over WAV is a format clients ask
for, CRC-checked frames, and a stream whose length needs no header. The STREAMINFO block leaves the
total samples, frame sizes and MD5 unknown (0), as the format allows for a stream encoded live.
"""

from __future__ import annotations

BLOCK_SAMPLES = 4096
_BITS = 16


def _crc_table(polynomial: int, width: int) -> list[int]:
    top, mask, table = 1 << (width - 1), (1 << width) - 1, []
    for byte in range(256):
        crc = byte << (width - 8)
        for _ in range(8):
            crc = ((crc << 1) ^ polynomial) & mask if crc & top else (crc << 1) & mask
        table.append(crc)
    return table


_CRC8, _CRC16 = _crc_table(0x07, 8), _crc_table(0x8005, 16)


def crc8(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc = _CRC8[crc ^ byte]
    return crc


def crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[(crc >> 8) ^ byte]
    return crc


def _utf8_number(n: int) -> bytes:
    """A frame number as FLAC writes it: UTF-8's variable-length coding, extended to 36 bits."""
    if n < 0x80:
        return bytes([n])
    tail = []
    while True:
        tail.append(0x80 | (n & 0x3F))
        n >>= 6
        lead_bits = 6 - len(tail)  # payload bits left in the first byte
        if n < (1 << lead_bits):
            marker = (0xFF << (7 - len(tail))) & 0xFF
            return bytes([marker | n, *reversed(tail)])


class FlacEncoder:
    def __init__(self, sample_rate: int) -> None:
        if not 0 < sample_rate < 1 << 20:
            raise ValueError(f"FLAC cannot carry a sample rate of {sample_rate} Hz")
        self.sample_rate = sample_rate
        self._pending = b""
        self._frames = 0

    def header(self) -> bytes:
        """"fLaC", then STREAMINFO as the last metadata block."""
        info = (BLOCK_SAMPLES.to_bytes(2, "big") * 2 + bytes(6)  # block sizes; frame sizes unknown
                + ((self.sample_rate << 44) | (0 << 41) | ((_BITS - 1) << 36)).to_bytes(8, "big")  # total samples: 0
                + bytes(16))  # no MD5
        return b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info

    def encode(self, pcm: bytes) -> bytes:
        """Little-endian 16-bit samples in; every whole block out as a frame."""
        self._pending += pcm
        whole = len(self._pending) // (2 * BLOCK_SAMPLES) * 2 * BLOCK_SAMPLES
        out = b"".join(self._frame(self._pending[n:n + 2 * BLOCK_SAMPLES]) for n in range(0, whole, 2 * BLOCK_SAMPLES))
        self._pending = self._pending[whole:]
        return out

    def end(self) -> bytes:
        """The last, shorter block."""
        rest, self._pending = self._pending, b""
        return self._frame(rest) if rest else b""

    def _frame(self, pcm: bytes) -> bytes:
        samples = len(pcm) // 2
        rate_code, rate_bytes = self._rate()
        header = (bytes([0xFF, 0xF8, (0b0111 << 4) | rate_code, (0b0000 << 4) | (0b100 << 1)])
                  + _utf8_number(self._frames) + (samples - 1).to_bytes(2, "big") + rate_bytes)
        header += bytes([crc8(header)])
        self._frames += 1
        import numpy as np  # here: an API node that never encodes FLAC does not import it at start

        body = header + b"\x02" + np.frombuffer(pcm, "<i2").astype(">i2").tobytes()  # a VERBATIM subframe
        return body + crc16(body).to_bytes(2, "big")

    def _rate(self) -> tuple[int, bytes]:
        """The frame's sample rate: in Hz in 16 bits, in tens of Hz, or (else) STREAMINFO's."""
        if self.sample_rate < 1 << 16:
            return 0b1101, self.sample_rate.to_bytes(2, "big")
        if self.sample_rate % 10 == 0 and self.sample_rate // 10 < 1 << 16:
            return 0b1110, (self.sample_rate // 10).to_bytes(2, "big")
        return 0b0000, b""
