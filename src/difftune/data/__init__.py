"""The unified dataset and its operators."""

from .dataset import UnifiedDataset, names, read_metadata
from .operators import (CHECKED, IMAGE_EXTENSIONS, DataError, DataOperator, ImageCropAndResize, Lambda, LoadImage,
                        RouteByExtension, Sequence, ToAbsolutePath, compose, cover_crop, target_size)
from .video import CLIP_EXTENSIONS, STILL_EXTENSIONS, LoadVideo, ToClip, video_operator

__all__ = ["CHECKED", "CLIP_EXTENSIONS", "IMAGE_EXTENSIONS", "STILL_EXTENSIONS", "DataError", "DataOperator",
           "ImageCropAndResize", "Lambda", "LoadImage", "LoadVideo", "RouteByExtension", "Sequence", "ToAbsolutePath",
           "ToClip", "UnifiedDataset", "compose", "cover_crop", "names", "read_metadata", "target_size",
           "video_operator"]
