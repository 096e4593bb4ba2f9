"""Video rewards: videos come as uint8 [n, F, H, W, 3] (a video family's decoded samples).

- `frame_average(fn)`: an image reward scored on every frame, averaged over the frames (the
  registry serves it as `frames_<name>` for every image reward <name>).
- `temporal_consistency`: how little consecutive frames differ, 1 - mean |f_{t+1} - f_t| / 255
  in [0, 1]; a reward that needs time (a single frame has no score).
"""

from __future__ import annotations

import torch


def frame_average(fn):
    """The image reward `fn` on each frame of [n, F, H, W, 3], then the mean over frames (each
    component of a dict output too). Prompts and metadata repeat for each of a video's frames."""

    def score(videos: torch.Tensor, prompts: list, metadata: list):
        n, f = videos.shape[:2]
        out = fn(videos.reshape(n * f, *videos.shape[2:]), [p for p in prompts for _ in range(f)],
                 [m for m in metadata for _ in range(f)])
        parts = dict(out) if isinstance(out, dict) else {"score": out}
        means = {k: torch.as_tensor(v, dtype=torch.float32).reshape(n, f).mean(1) for k, v in parts.items()}
        return means if isinstance(out, dict) else means["score"]

    return score


def temporal_consistency(videos: torch.Tensor, prompts: list, metadata: list) -> torch.Tensor:
    if videos.shape[1] < 2:
        raise ValueError(f"temporal_consistency needs at least 2 frames, got {videos.shape[1]}")
    frames = videos.float() / 255
    return 1 - (frames[:, 1:] - frames[:, :-1]).abs().mean(dim=(1, 2, 3, 4))
