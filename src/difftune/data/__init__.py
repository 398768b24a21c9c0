"""The unified dataset and its operators."""

from .dataset import UnifiedDataset, names, read_metadata
from .operators import (CHECKED, IMAGE_EXTENSIONS, DataError, DataOperator, ImageCropAndResize, Lambda, LoadImage,
                        RouteByExtension, RouteByListing, Sequence, ToAbsolutePath, compose, cover_crop, target_size)

__all__ = ["CHECKED", "IMAGE_EXTENSIONS", "DataError", "DataOperator", "ImageCropAndResize", "Lambda", "LoadImage",
           "RouteByExtension", "RouteByListing", "Sequence", "ToAbsolutePath", "UnifiedDataset", "compose", "cover_crop", "names",
           "read_metadata", "target_size"]
