"""What a data source holds: the list of samples, checked once when a run starts.

Sources (the ``source`` string of TrainData / EvalData)
    ``synthetic``                in-memory data (see gems.train.datasets); no listing.
    FOLDER with images/, masks/  segmentation pairs: images/NAME.ext <-> masks/NAME.png (or .tif/.tiff).
    FOLDER of class folders      classification, an ImageFolder tree root/class_name/image.ext.
    FILE.csv                     classification, rows ``path,label``: paths relative to the CSV's folder,
                                 labels integers or class names (classes sorted, index = position); an
                                 optional first row ``path,label`` is a header.

``PredictImages(folder)`` lists the images to predict: a folder of images, or a pairs folder's images/.

Every problem found here is a GemsError with one sentence naming the file and the fix: an image without
a mask or a mask without an image, a mask whose size differs from its image's (headers only: nothing is
decoded here), an empty folder, a CSV row that is malformed, names a missing file or a label out of
range, a layout that does not fit the task. Files that exist but cannot be decoded are not found here:
they are skipped while training (see gems.train.data).
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field

from gems.errors import GemsError
from gems.train.images import IMAGE_EXTENSIONS, MASK_EXTENSIONS, header_size
from gems.train.targets import IGNORE

TASKS = ("classification", "segmentation")


@dataclass
class Listing:
    """The samples of a file source: (image path, class index or IGNORE) for classification, (image path,
    mask path) for segmentation, in listing order."""
    kind: str                                   # "pairs", "classes" or "csv"
    samples: list[tuple[str, int]] | list[tuple[str, str]]
    num_classes: int | None
    classes: list[str] = field(default_factory=list)


def is_pairs_folder(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "images")) and os.path.isdir(os.path.join(path, "masks"))


def list_source(source: str, task: str, num_classes: int | None, ignore_index: int | None) -> Listing:
    """The listing of a folder or CSV source for ``task`` (GemsError for anything that cannot work)."""
    source = os.fspath(source)
    if not os.path.exists(source):
        raise GemsError(f"data source {source!r} is neither 'synthetic' nor an existing folder or CSV file: "
                        "pass 'synthetic', a folder (images/ + masks/ pairs, or one subfolder per class) or "
                        "a .csv file of path,label rows")
    if os.path.isfile(source):
        if not source.lower().endswith(".csv"):
            raise GemsError(f"data source {source!r} is a file, not a folder or a .csv file: pass the root "
                            "folder of the images (or a CSV file of path,label rows named *.csv)")
        if task != "classification":
            raise GemsError(f"{source!r} is a CSV of image labels, a classification source, but the task is "
                            f"{task}: pass task classification, or a folder with images/ and masks/")
        return csv_listing(source, num_classes, ignore_index)
    if is_pairs_folder(source):
        if task != "segmentation":
            raise GemsError(f"{source!r} holds images/ and masks/ (segmentation pairs) but the task is {task}:"
                            " pass task segmentation (--task segmentation)")
        return pairs_listing(source)
    if task == "segmentation":
        raise GemsError(f"{source!r} has no images/ and masks/ subfolders: for segmentation put each image "
                        "in FOLDER/images and its mask, with the same name, in FOLDER/masks")
    return class_folder_listing(source, num_classes)


def image_files(folder: str, extensions: tuple[str, ...]) -> dict[str, str]:
    """NAME -> path of the files of ``folder`` with those extensions (hidden files skipped)."""
    found: dict[str, str] = {}
    for entry in sorted(os.listdir(folder)):
        stem, ext = os.path.splitext(entry)
        path = os.path.join(folder, entry)
        if entry.startswith(".") or ext.lower() not in extensions or not os.path.isfile(path):
            continue
        if stem in found:
            raise GemsError(f"{found[stem]} and {path} have the same name: keep one file per name in {folder}")
        found[stem] = path
    return found


def _first(names: list[str]) -> str:
    return names[0] + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")


def pairs_listing(root: str) -> Listing:
    """images/NAME.ext <-> masks/NAME.(png|tif|tiff), sorted by NAME, sizes checked from the headers."""
    images = image_files(os.path.join(root, "images"), IMAGE_EXTENSIONS)
    masks = image_files(os.path.join(root, "masks"), MASK_EXTENSIONS)
    if not images and not masks:
        raise GemsError(f"{root!r} has no image/mask pairs: put images in {os.path.join(root, 'images')} "
                        f"and masks with the same names in {os.path.join(root, 'masks')}")
    lonely = sorted(images[n] for n in images.keys() - masks.keys())
    if lonely:
        raise GemsError(f"image {_first(lonely)} has no mask: add masks/NAME.png with the image's name, "
                        "or remove the image")
    lonely = sorted(masks[n] for n in masks.keys() - images.keys())
    if lonely:
        raise GemsError(f"mask {_first(lonely)} has no image: add images/NAME.ext with the mask's name, "
                        "or remove the mask")
    samples = [(images[n], masks[n]) for n in sorted(images)]
    for image, mask in samples:
        try:
            image_size, mask_size = header_size(image), header_size(mask)
        except Exception:   # unreadable header: the file is skipped when it is decoded
            continue
        if image_size != mask_size:
            raise GemsError(f"mask {mask} is {mask_size[0]}x{mask_size[1]} pixels but its image {image} is "
                            f"{image_size[0]}x{image_size[1]}: save the mask at the image's size")
    return Listing("pairs", samples, None)


def class_folder_listing(root: str, num_classes: int | None) -> Listing:
    """An ImageFolder tree: one subfolder per class (sorted), files listed only, none opened."""
    from torchvision.datasets import ImageFolder  # noqa: PLC0415

    try:  # lists files only; no image is opened here
        folder = ImageFolder(root, loader=lambda path: path)
    except FileNotFoundError:
        raise GemsError(f"{root!r} has no class subfolders with images: arrange it as "
                        "root/class_name/image.jpg (one subfolder per class), or root/images + root/masks "
                        "for segmentation") from None
    if num_classes is not None and num_classes != len(folder.classes):
        raise GemsError(f"{root!r} has {len(folder.classes)} class folders but num_classes is "
                        f"{num_classes}: leave num_classes unset or make them agree")
    return Listing("classes", list(folder.samples), len(folder.classes), list(folder.classes))


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def csv_listing(path: str, num_classes: int | None, ignore_index: int | None) -> Listing:
    """Rows ``path,label`` (see the module docstring); every image must exist."""
    base = os.path.dirname(os.path.abspath(path))
    rows: list[tuple[int, str, str]] = []
    with open(path, newline="", encoding="utf-8") as f:
        for line, row in enumerate(csv.reader(f), 1):
            if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
                continue
            if len(row) != 2:
                raise GemsError(f"{path} line {line} has {len(row)} fields, not 2: write each row as "
                                "path,label (quote a path that contains a comma)")
            image, label = row[0].strip(), row[1].strip()
            if not rows and (image.lower(), label.lower()) == ("path", "label"):
                continue  # header
            rows.append((line, image, label))
    if not rows:
        raise GemsError(f"{path} lists no images: add rows path,label")
    numbers = [_int(label) for _, _, label in rows]
    named = any(n is None for n in numbers)
    classes = sorted({label for _, _, label in rows}) if named else []
    index = {name: i for i, name in enumerate(classes)}
    if named and num_classes is not None and num_classes != len(classes):
        raise GemsError(f"{path} names {len(classes)} classes but num_classes is {num_classes}: leave "
                        "num_classes unset or make them agree")
    if not named:
        kept = [n for n in numbers if n != ignore_index]
        num_classes = num_classes if num_classes is not None else max(kept, default=-1) + 1
    samples = []
    for (line, image, label), number in zip(rows, numbers):
        full = os.path.join(base, image)
        if not os.path.isfile(full):
            raise GemsError(f"{path} line {line}: image {full} does not exist: fix the path (relative to the "
                            "CSV's folder) or remove the row")
        if named:
            samples.append((full, index[label]))
        elif number == ignore_index:
            samples.append((full, IGNORE))
        elif not 0 <= number < num_classes:
            raise GemsError(f"{path} line {line}: label {number} is not a class index below num_classes="
                            f"{num_classes}: fix the label or raise num_classes")
        else:
            samples.append((full, number))
    num_classes = len(classes) if named else num_classes
    if not num_classes:
        raise GemsError(f"{path} has no labelled image (every label is the ignore index): add labelled rows")
    return Listing("csv", samples, num_classes, classes)


class PredictImages(list):
    """The image files to predict, sorted by name: FOLDER's own, or FOLDER/images' when it has one (a
    pairs folder: its masks are not read); a folder holding only subfolders (class folders) is read
    one level down, the images named by their subfolder. Read each with ``read_image(path, channels)``."""

    def __init__(self, folder: str):
        if not os.path.isdir(folder):
            raise GemsError(f"{folder!r} is not a folder: pass a folder of images (or a folder with images/)")
        root = os.path.join(folder, "images") if os.path.isdir(os.path.join(folder, "images")) else folder
        found = image_files(root, IMAGE_EXTENSIONS)
        if not found:   # class folders: root/class/image
            for sub in sorted(e.name for e in os.scandir(root) if e.is_dir()):
                found.update({f"{sub}/{name}": path
                              for name, path in image_files(os.path.join(root, sub), IMAGE_EXTENSIONS).items()})
        if not found:
            raise GemsError(f"{root!r} holds no images ({', '.join(IMAGE_EXTENSIONS)}): pass a folder of "
                            "images to predict")
        super().__init__(found[name] for name in sorted(found))
        self.root = root   # the folder the images were listed from (outputs are named relative to it)
