"""Images are checked at the API before anything is stored or a runner spends time on them: a
truncated PNG, an image of more pixels than EXO_MAX_IMAGE_PIXELS (a 420 KB PNG of 12000 x 12000
took a runner 15 s) and one too elongated for a vision processor are 400s naming the image. They
used to be 500s from the runner ("image file is truncated", "aspect ratio")."""

from __future__ import annotations

import io

import PIL.Image
import pytest

from exo.api.errors import ApiError
from exo.api.images import check_image
from exo.settings.services import ApiSettings
from tests.support.images import random_png

MAX_IMAGE_PIXELS = ApiSettings().max_image_pixels


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    PIL.Image.new("L", (width, height)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize(("data", "message"), [
    (random_png(5000)[:-200], "image 2 of the request is damaged"),
    (b"not an image at all", "image 2 of the request is not an image this model can read"),
    (_png(1, 100_000), "image 2 of the request is 1 x 100000 pixels: its sides may differ at most 200 times"),
    (_png(5000, 5000), f"image 2 of the request is 5000 x 5000 pixels, over the limit of {MAX_IMAGE_PIXELS}"),
])
def test_images_no_vision_model_should_get_are_400_naming_where_they_are(data, message):
    with pytest.raises(ApiError) as refused:
        check_image(data, "messages[0].content[1]", "image 2 of the request")
    assert (refused.value.status, refused.value.param) == (400, "messages[0].content[1]")
    assert message in str(refused.value)


def test_sound_images_pass():
    check_image(random_png(5000), "p")
    check_image(_png(4096, 4096), "p")  # at the limit
    check_image(_png(2, 400), "p")  # as elongated as may be
