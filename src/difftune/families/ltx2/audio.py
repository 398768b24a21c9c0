"""LTX-2's sound: the log-mel spectrogram its audio VAE encodes, and a clip's sound track aligned to its frames.

The spectrogram is the reference's (torchaudio's `MelSpectrogram` there; computed here with torch alone): 16 kHz
stereo, a 1024-point periodic Hann window, hop 160, centred with reflection, magnitude (power 1), 64 mel bands on
the Slaney scale with Slaney area normalisation from 0 Hz to 8 kHz, then log(max(x, 1e-5)); (B, channels, frames,
64). Diffusers' audio VAE takes the same input and has no front end of its own.
"""

from __future__ import annotations

import math

import torch

from ...data.audio import SHORTFALL_SECONDS

SAMPLE_RATE = 16000
N_FFT = 1024
HOP = 160
MEL_BINS = 64
LATENT_HOP = HOP * 4  # waveform samples per audio latent step (the VAE halves time twice): 25 latents a second


def _hz_to_slaney(f):
    f = torch.as_tensor(f, dtype=torch.float64)
    linear = 3.0 * f / 200.0
    log_part = 15.0 + torch.log(f.clamp(min=1e-10) / 1000.0) / (math.log(6.4) / 27.0)
    return torch.where(f >= 1000.0, log_part, linear)


def _slaney_to_hz(m):
    linear = 200.0 * m / 3.0
    log_part = 1000.0 * torch.exp((math.log(6.4) / 27.0) * (m - 15.0))
    return torch.where(m >= 15.0, log_part, linear)


def mel_filters(sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = MEL_BINS) -> torch.Tensor:
    """(n_mels, n_fft // 2 + 1) triangular filters on the Slaney mel scale with Slaney (area) normalisation, from
    0 Hz to Nyquist: librosa's `filters.mel(htk=False, norm="slaney")`, torchaudio's `melscale_fbanks(...,
    norm="slaney", mel_scale="slaney")`."""
    freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    edges = _slaney_to_hz(torch.linspace(float(_hz_to_slaney(0.0)), float(_hz_to_slaney(sample_rate / 2)),
                                         n_mels + 2, dtype=torch.float64))
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (freqs - lower) / (centre - lower)
    falling = (upper - freqs) / (upper - centre)
    filters = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return (filters * (2.0 / (upper - lower))).to(torch.float32)


_FILTERS: dict = {}


def log_mel(wave: torch.Tensor) -> torch.Tensor:
    """(B, channels, samples) at 16 kHz -> (B, channels, frames, 64) log-mel, float32."""
    b, c, n = wave.shape
    if n <= N_FFT // 2:  # reflection padding needs more than half a window
        raise ValueError(f"{n} samples: LTX-2's audio needs more than {N_FFT // 2} ({(N_FFT // 2 + 1) / SAMPLE_RATE:.3f} s)")
    x = wave.reshape(b * c, n).to(torch.float32)
    window = torch.hann_window(N_FFT, periodic=True, dtype=torch.float32, device=x.device)
    spec = torch.stft(x, N_FFT, hop_length=HOP, win_length=N_FFT, window=window, center=True, pad_mode="reflect",
                      return_complex=True).abs()
    key = str(x.device)
    if key not in _FILTERS:
        _FILTERS[key] = mel_filters().to(x.device)
    mel = torch.matmul(_FILTERS[key], spec)  # (B*C, mels, frames)
    mel = torch.log(torch.clamp(mel, min=1e-5))
    return mel.reshape(b, c, MEL_BINS, -1).transpose(2, 3).contiguous()


def aligned_samples(num_frames: int, frame_rate: float, sample_rate: int = SAMPLE_RATE) -> int:
    """Waveform samples that last as long as `num_frames` frames at `frame_rate` (the reference's int(duration *
    rate))."""
    return int(num_frames / float(frame_rate) * sample_rate)


_NOTED: set = set()


def align(wave: torch.Tensor, samples: int, where: str, log=print) -> torch.Tensor:
    """A sound track (channels, n) cut or padded with silence to `samples`, with a note (once per `where`) when it
    was shorter than its clip by more than an encoder's padding (`SHORTFALL_SECONDS`: an AAC track ends a few
    milliseconds early): the rest of the clip then trains as silent."""
    n = wave.shape[-1]
    if n >= samples:
        return wave[..., :samples]
    if (samples - n) / SAMPLE_RATE > SHORTFALL_SECONDS and where not in _NOTED:
        _NOTED.add(where)
        log(f"note: {where}: the sound lasts {n / SAMPLE_RATE:.2f} s, its clip {samples / SAMPLE_RATE:.2f} s: the "
            f"rest is padded with silence")
    return torch.nn.functional.pad(wave, (0, samples - n))


__all__ = ["HOP", "LATENT_HOP", "MEL_BINS", "N_FFT", "SAMPLE_RATE", "align", "aligned_samples", "log_mel",
           "mel_filters"]
