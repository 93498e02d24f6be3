"""A Vision Transformer classifier in Flax NNX (conv patch embedding, cross-entropy over classes),
planned and trained by shardmem from YAML.

    shardmem plan examples/vit.yaml --target h100-sxm
    shardmem plan examples/vit.yaml --target h100-sxm --set model.options={}   # ViT-B/16 at 224 x 224
    shardmem train examples/vit.yaml --run-dir runs/vit

``build`` takes ``remat`` (the config's per-layer plan) and runs its blocks with
:func:`shardmem.remat_scan`; the batch (images and labels) and its source are declared in the YAML.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import shardmem


def _init(axes, init=None):
    return nnx.with_partitioning(init or nnx.initializers.lecun_normal(), axes)


class Block(nnx.Module):
    def __init__(self, width, heads, mlp, dropout, rngs):
        self.norm1 = nnx.LayerNorm(
            width,
            scale_init=_init(("norm",), nnx.initializers.ones),
            bias_init=_init(("norm",), nnx.initializers.zeros),
            rngs=rngs,
        )
        self.attn = nnx.MultiHeadAttention(
            heads,
            width,
            decode=False,
            rngs=rngs,
            kernel_init=_init(("embed", "heads", "head_dim")),
            out_kernel_init=_init(("heads", "head_dim", "embed")),
            bias_init=_init(("heads", "head_dim"), nnx.initializers.zeros),
            out_bias_init=_init(("embed",), nnx.initializers.zeros),
        )
        self.norm2 = nnx.LayerNorm(
            width,
            scale_init=_init(("norm",), nnx.initializers.ones),
            bias_init=_init(("norm",), nnx.initializers.zeros),
            rngs=rngs,
        )
        self.up = nnx.Linear(
            width,
            mlp,
            kernel_init=_init(("embed", "mlp")),
            bias_init=_init(("mlp",), nnx.initializers.zeros),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            mlp,
            width,
            kernel_init=_init(("mlp", "embed")),
            bias_init=_init(("embed",), nnx.initializers.zeros),
            rngs=rngs,
        )
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x_BxNxD):
        h = self.norm1(x_BxNxD)
        x_BxNxD = x_BxNxD + self.dropout(checkpoint_name(self.attn(h, h, h), "attention_out"))
        h = checkpoint_name(jax.nn.gelu(self.up(self.norm2(x_BxNxD))), "mlp_hidden")
        return x_BxNxD + self.dropout(self.down(h))


class ViT(nnx.Module):
    def __init__(
        self,
        rngs,
        remat,
        *,
        image=224,
        patch=16,
        width=768,
        depth=12,
        heads=12,
        mlp=3072,
        classes=1000,
        dropout=0.1,
    ):
        self.remat = remat
        self.patch = nnx.Conv(
            3,
            width,
            (patch, patch),
            strides=(patch, patch),
            padding="VALID",
            rngs=rngs,
            kernel_init=_init((None, None, None, "embed")),
            bias_init=_init(("embed",), nnx.initializers.zeros),
        )
        tokens = (image // patch) ** 2 + 1
        self.cls = nnx.Param(
            _init((None, None, "embed"), nnx.initializers.zeros)(rngs.params(), (1, 1, width))
        )
        self.position = nnx.Param(
            _init((None, None, "embed"), nnx.initializers.normal(0.02))(rngs.params(), (1, tokens, width))
        )

        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def blocks(rngs):
            return Block(width, heads, mlp, dropout, rngs)

        self.blocks = blocks(rngs)
        self.norm = nnx.LayerNorm(
            width,
            scale_init=_init(("norm",), nnx.initializers.ones),
            bias_init=_init(("norm",), nnx.initializers.zeros),
            rngs=rngs,
        )
        self.head = nnx.Linear(
            width,
            classes,
            kernel_init=_init(("embed", "classes")),
            bias_init=_init(("classes",), nnx.initializers.zeros),
            rngs=rngs,
        )

    def __call__(self, images_BxHxWxC):
        x = self.patch(images_BxHxWxC)
        b, h, w, d = x.shape
        x_BxNxD = x.reshape(b, h * w, d)
        cls_Bx1xD = jnp.broadcast_to(self.cls[...], (b, 1, d))
        x_BxNxD = jnp.concatenate([cls_Bx1xD, x_BxNxD], axis=1) + self.position[...]
        x_BxNxD = shardmem.remat_scan(self.blocks, x_BxNxD, self.remat)
        return self.head(self.norm(x_BxNxD[:, 0]))


def build(rngs, remat, **options):
    return ViT(rngs, remat, **options)


def loss(model, batch):
    logits = model(batch["images"])
    labels = batch["labels"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()
    return loss, {"accuracy": (logits.argmax(-1) == labels).mean()}


def batches(step, rows, seed, *, image=32, classes=10):
    """Synthetic images whose class is the quadrant holding a bright square, the same for a given
    (seed, step, row) whichever process asks."""
    images = np.zeros((len(rows), image, image, 3), np.float32)
    labels = np.zeros(len(rows), np.int32)
    half = image // 2
    for i, row in enumerate(rows):
        rng = np.random.default_rng((seed, step, row))
        label = int(rng.integers(0, min(classes, 4)))
        y, x = divmod(label, 2)
        images[i] = rng.normal(0, 0.1, images.shape[1:])
        images[i, y * half : (y + 1) * half, x * half : (x + 1) * half] += 1.0
        labels[i] = label
    return {"images": images, "labels": labels}
