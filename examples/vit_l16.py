"""ViT-L/16 (304M parameters) for image classification, laid out as torchvision's.

    memcheck examples/vit_l16.py --batch-size 32 --gpu A100-80GB --precision amp-bf16

torchvision is not a dependency of memcheck, so the model is written out here with the
structure of ``torchvision.models.vision_transformer`` (``vit_l_16``: patch 16, 24 layers,
width 1024, 16 heads, MLP 4096, 224 x 224 images, 1000 classes). Each block calls
``nn.MultiheadAttention(..., need_weights=False)`` as torchvision's ``EncoderBlock`` does:
on a GPU that runs a fused attention kernel inside ``F.multi_head_attention_forward``,
which memcheck follows. torchvision's defaults have no dropout; set ``DROPOUT`` to train
with it (each dropout then keeps a one-byte mask on the GPU).
"""

import torch
from torch import nn

DROPOUT = 0.0
ATTENTION_DROPOUT = 0.0


class EncoderBlock(nn.Module):
    def __init__(self, heads, hidden, mlp, dropout, attention_dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(hidden, heads, dropout=attention_dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(mlp, hidden), nn.Dropout(dropout))

    def forward(self, x):
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = self.dropout(y) + x
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    def __init__(self, image_size=224, patch_size=16, layers=24, heads=16, hidden=1024, mlp=4096,
                 classes=1000, dropout=DROPOUT, attention_dropout=ATTENTION_DROPOUT):
        super().__init__()
        self.patch_size = patch_size
        self.conv_proj = nn.Conv2d(3, hidden, kernel_size=patch_size, stride=patch_size)
        tokens = (image_size // patch_size) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos_embedding = nn.Parameter(torch.empty(1, tokens, hidden).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential(*[EncoderBlock(heads, hidden, mlp, dropout, attention_dropout)
                                      for _ in range(layers)])
        self.ln = nn.LayerNorm(hidden, eps=1e-6)
        self.heads = nn.Linear(hidden, classes)

    def forward(self, images):
        x = self.conv_proj(images).flatten(2).transpose(1, 2)  # (B, patches, hidden)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.ln(self.layers(self.dropout(x + self.pos_embedding)))
        return self.heads(x[:, 0])


def build_model():
    return VisionTransformer()


def make_batch(batch_size, max_len=None):
    return torch.randn(batch_size, 3, 224, 224), torch.randint(0, 1000, (batch_size,))


def compute_loss(model, batch):
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)
