"""The unified dataset and its operators."""

from .audio import AUDIO_SOURCE_EXTENSIONS, AudioPath, LoadAudio, audio_operator, audio_path_operator
from .dataset import UnifiedDataset, names, read_metadata
from .operators import (CHECKED, IMAGE_EXTENSIONS, DataError, DataOperator, ImageCropAndResize, Lambda, LoadImage,
                        RouteByExtension, RouteByListing, Sequence, ToAbsolutePath, compose, cover_crop, target_size)
from .video import CLIP_EXTENSIONS, STILL_EXTENSIONS, LoadVideo, ToClip, video_operator

__all__ = ["AUDIO_SOURCE_EXTENSIONS", "AudioPath", "LoadAudio", "audio_operator", "audio_path_operator",
           "CHECKED", "CLIP_EXTENSIONS", "IMAGE_EXTENSIONS", "STILL_EXTENSIONS", "DataError", "DataOperator",
           "ImageCropAndResize", "Lambda", "LoadImage", "LoadVideo", "RouteByExtension", "RouteByListing", "Sequence",
           "ToAbsolutePath", "ToClip", "UnifiedDataset", "compose", "cover_crop", "names", "read_metadata",
           "target_size", "video_operator"]
