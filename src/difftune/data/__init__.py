"""The unified dataset and its operators."""

from .dataset import UnifiedDataset, read_metadata
from .operators import (DataOperator, ImageCropAndResize, LoadImage, RouteByExtension, ToAbsolutePath, cover_crop,
                        target_size)

__all__ = ["DataOperator", "ImageCropAndResize", "LoadImage", "RouteByExtension", "ToAbsolutePath", "UnifiedDataset",
           "cover_crop", "read_metadata", "target_size"]
