# TreeAdapter-KleinBase4B is a multi-LoRA system that supports inference only.
# For training, please refer to the training scripts in Template-KleinBase4B-Aesthetic.