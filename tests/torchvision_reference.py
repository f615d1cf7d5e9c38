"""What a transformers user with torchvision gets: each checkpoint's ``AutoProcessor`` (its image processor on the
torchvision backend) on a rendered prompt and its images. Run in a subprocess with the folder of a torchvision
wheel on ``PYTHONPATH`` (``tests/test_vl_torchvision_reference.py``), never in the test process: there
transformers would take the torchvision backend for every image processor.

Usage: ``python torchvision_reference.py JOBS.json OUT.pt``; JOBS holds ``[{"checkpoint", "text", "images"}]``
(image file paths), OUT gets each job's processor outputs and the image processor's backend.
"""
import json
import sys
import types

# PyPI's torchvision wheel is a CUDA build whose compiled ops do not load against the CPU torch; only its meta
# registrations need them, and the image transforms do not
sys.modules['torchvision._meta_registrations'] = types.ModuleType('torchvision._meta_registrations')

import torch  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import AutoProcessor  # noqa: E402


def main(jobs_path: str, out_path: str) -> None:
    with open(jobs_path) as f:
        jobs = json.load(f)
    processors, results = {}, []
    for job in jobs:
        checkpoint = job['checkpoint']
        if checkpoint not in processors:
            processors[checkpoint] = AutoProcessor.from_pretrained(checkpoint)
        processor = processors[checkpoint]
        images = [Image.open(path) for path in job['images']]
        out = processor(text=[job['text']], images=images, add_special_tokens=False, return_tensors='pt')
        results.append({'backend': processor.image_processor.backend,
                        **{key: value for key, value in out.items() if isinstance(value, torch.Tensor)}})
    torch.save(results, out_path)


if __name__ == '__main__':
    main(*sys.argv[1:])
