"""Coverage of the installed transformers (issue 18): every architecture of the Auto mappings at tiny
size, one real CPU training step pair against memcheck's CPU estimate, within 2%.

The cases and the shrinking are in tests/hf_coverage.py; benchmarks/coverage.py prints the table
that the README shows. The oracle is ``measure_cpu``'s allocator peak (profiler events) of two real
AdamW steps, from the second step on, as tests/test_accuracy_cpu.py. An architecture that cannot
pass is in ``EXPECTED_FAILURES`` with what was observed; strict where it fails the same way every
time, so that a fix shows up as an unexpected pass.
"""

from pathlib import Path

import pytest

from hf_coverage import cases, run_case

TOLERANCE = 0.02  # as tests/test_accuracy_cpu.py

# model_type -> reason (observed on transformers 5.23, torch 2.13.0+cpu)
EXPECTED_FAILURES: dict[str, str] = {
    'align': 'real failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x64 and 80x2)',
    'audio-spectrogram-transformer': 'real failed: IndexError: Dimension out of range (expected to be in range of [-3, 2], but got 3)',
    'axk1': 'real failed: RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1',
    'axk2': 'real failed: RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1',
    'bailing_hybrid': "real failed: RuntimeError: shape '[-1, 8, 0]' is invalid for input of size 256",
    'bit': 'build failed: ModelLoadError: cannot build BitConfig for task None: num_channels (8) must be divisible by num_groups (32)',
    'blip-2': 'batch failed: ModelLoadError: Blip2ForImageTextRetrieval is no image-text model: its forward takes no input_ids, pixel_values and return_loss, which contrastive tra',
    'blt': "real failed: AttributeError: 'BltConfig' object has no attribute 'num_hidden_layers'",
    'canary': "batch failed: ModelLoadError: memcheck cannot build a batch for CanaryForConditionalGeneration: its main input is 'input_features'; write a model file with build_mo",
    'cohere_asr': "batch failed: ModelLoadError: memcheck cannot build a batch for CohereAsrForConditionalGeneration: its main input is 'input_features'; write a model file with build",
    'cohere_compass_text': "build failed: ModelLoadError: cannot build CohereCompassTextConfig for task None: 'full_attention'",
    'cvt': 'build failed: IndexError: list index out of range',
    'dbrx': "build failed: AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta'",
    'deepseek_v2': 'real failed: RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1',
    'deepseek_v3': 'real failed: RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1',
    'deepseek_v32': 'real failed: RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1',
    'dia': 'real failed: IndexError: index out of range in self',
    'dinat': 'build failed: ModelLoadError: cannot build DinatConfig for task None: DinatForImageClassification requires the natten library but it was not found in your environme',
    'dots1': 'build failed: ModelLoadError: cannot build Dots1Config for task None: empty() takes 1 positional argument but 3 were given',
    'dots3_note': 'config failed: ValueError: `per_layer_config` keys must be integer layer indices in the range [0, 2); got [2, 3, 4, 6, 7, 8, 10, 11, 12, 14, 15, 16, 18, 19, 20, 22, ',
    'dots3_note_text': "config failed: StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':",
    'emu3': "build failed: AttributeError: 'Emu3Config' object has no attribute 'pad_token_id'",
    'esm': "build failed: ModelLoadError: cannot build EsmConfig for task None: empty(): argument 'size' (position 1) must be tuple of ints, but found element of type NoneType ",
    'esmc': "config failed: StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':",
    'fsmt': 'real failed: ValueError: Expected input batch_size (64) to match target batch_size (32).',
    'fun_asr_nano': "config failed: StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':",
    'gemma3n': 'config failed: ValueError: intermediate_size must have an explicit intermediate size for every layer or one for all layers. Expected 2 values but got 35.',
    'gemma3n_text': 'build failed: ModelLoadError: cannot build Gemma3nTextConfig for task None: The set of layer types producing a cache is different than the set of layer types using ',
    'gemma4': 'config failed: ValueError: `per_layer_config` keys must be integer layer indices in the range [0, 2); got [5, 11, 17, 23, 29].',
    'gemma4_assistant': "config failed: StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':",
    'gemma4_unified': 'config failed: ValueError: `per_layer_config` keys must be integer layer indices in the range [0, 2); got [5, 11, 17, 23, 29].',
    'gemma4_unified_assistant': 'config failed: ValueError: `per_layer_config` keys must be integer layer indices in the range [0, 2); got [5, 11, 17, 23, 29].',
    'git': 'real failed: ValueError: Expected input batch_size (28) to match target batch_size (62).',
    'glm4_moe_lite': 'real failed: RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1',
    'glm_moe_dsa': 'real failed: RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1',
    'gpt_neo': "config failed: StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':",
    'granite_speech5_ctc': "batch failed: ModelLoadError: memcheck cannot build a batch for GraniteSpeech5ForCTC: its main input is 'input_features'; write a model file with build_model() and ",
    'hgnet_v2': 'real failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x2048 and 128x2)',
    'hunyuan_v1_dense': "build failed: ModelLoadError: cannot build HunYuanDenseV1Config for task None: unsupported operand type(s) for ** or pow(): 'NoneType' and 'float'",
    'hunyuan_v1_moe': "build failed: ModelLoadError: cannot build HunYuanMoEV1Config for task None: unsupported operand type(s) for ** or pow(): 'NoneType' and 'float'",
    'imagegpt': 'real failed: ValueError: You have to specify either input_ids or inputs_embeds',
    'inkling2_text': '+12.62% (measured 99,980,416 B, estimated 112,595,952 B)',
    'inkling_text': '+6.12% (measured 92,676,872 B, estimated 98,345,996 B)',
    'ibert': 'estimate failed: TraceError: memcheck could not trace IBertForMaskedLM with --device cpu: AssertionError: NaN detected when computing min/max of the activation, raised inside transformers (transformers/models/ibert/qu',
    'jetmoe': "estimate failed: TraceError: JetMoeForCausalLM failed while being traced: RuntimeError: split_with_sizes expects split_sizes to sum exactly to 128 (input tensor's size",
    'kimi_linear': 'real failed: RuntimeError: selected index k out of range',
    'kyutai_speech_to_text': 'build failed: ModelLoadError: cannot build KyutaiSpeechToTextConfig for task None: in_channels must be divisible by groups',
    'lasr_ctc': "batch failed: ModelLoadError: memcheck cannot build a batch for LasrForCTC: its main input is 'input_features'; write a model file with build_model() and make_batch",
    'layoutlmv2': 'build failed: ModelLoadError: cannot build LayoutLMv2Config for task None: LayoutLMv2Model requires the detectron2 library but it was not found in your environment.',
    'layoutlmv3': 'real failed: RuntimeError: The size of tensor a (64) must match the size of tensor b (768) at non-singleton dimension 2',
    'led': 'estimate failed: TraceError: memcheck could not trace LEDForConditionalGeneration with --device cpu: AssertionError: AssertionError, raised inside transformers (transformers/models/led/modeling_led.py:460, _sliding_ch',
    'lfm2_moe': "build failed: ModelLoadError: cannot build Lfm2MoeConfig for task None: 'NoneType' object is not subscriptable",
    'lilt': 'real failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied (64x60 and 64x16)',
    'llama4': "build failed: AttributeError: 'Llama4Config' object has no attribute 'pad_token_id'",
    'longcat_flash': 'real failed: RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1',
    'longformer': 'estimate failed: TraceError: memcheck could not trace LongformerForMaskedLM with --device cpu: AssertionError: AssertionError, raised inside transformers (transformers/models/longformer/modeling_longformer.py:816, _sl',
    'mamba2': "config failed: StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':",
    'minicpm3': 'real failed: RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1',
    'ministral': "build failed: ModelLoadError: cannot build MinistralConfig for task None: unsupported operand type(s) for ** or pow(): 'NoneType' and 'float'",
    'mistral4': 'real failed: RuntimeError: The size of tensor a (8) must match the size of tensor b (4) at non-singleton dimension 3',
    'mobilebert': 'build failed: RuntimeError: Trying to create tensor with negative dimension -64: [-64, 1000]',
    'moonshine_streaming': "build failed: AttributeError: 'MoonshineStreamingConfig' object has no attribute 'num_key_value_heads'",
    'musicgen': "build failed: AttributeError: 'MusicgenConfig' object has no attribute 'dropout'",
    'musicgen_melody': "build failed: AttributeError: 'MusicgenMelodyConfig' object has no attribute 'dropout'",
    'nemo_speechlm': "config failed: StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':",
    'nemotron': "build failed: ModelLoadError: cannot build NemotronConfig for task None: unsupported operand type(s) for //: 'int' and 'NoneType'",
    'nemotron_h': 'real failed: RuntimeError: repeat_interleave: Invalid output_size, expected 0 but got 4',
    'neomme': 'config failed: ValueError: layer_types must contain at least one full_attention layer.',
    'olmo_hybrid': "config failed: StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':",
    'parakeet_ctc': "batch failed: ModelLoadError: memcheck cannot build a batch for ParakeetForCTC: its main input is 'input_features'; write a model file with build_model() and make_b",
    'perceiver': "batch failed: ModelLoadError: memcheck cannot build a batch for PerceiverForMaskedLM: its main input is 'inputs'; write a model file with build_model() and make_bat",
    'pp_lcnet': 'real failed: TraceError: PPLCNetForImageClassification(**batch) returned no .loss; pass labels in the batch or define compute_loss(model, batch)',
    'qwen3_5': "build failed: AttributeError: 'Qwen3_5Config' object has no attribute 'vocab_size'",
    'qwen3_5_moe': "build failed: AttributeError: 'Qwen3_5MoeConfig' object has no attribute 'vocab_size'",
    'qwen4_exp': "build failed: AttributeError: 'Qwen4ExpConfig' object has no attribute 'vocab_size'",
    'reformer': 'build failed: ModelLoadError: cannot build ReformerConfig for task None: Make sure that config.axial_pos_embds factors: (64, 192) sum to config.hidden_size: 64',
    'sew-d': 'estimate failed: TraceError: SEWDForCTC failed while being traced, in the meta kernel of aten.masked_fill.Tensor: RuntimeError: Expected `value` to be on same device a',
    'shieldgemma2': 'real failed: ValueError: You must specify exactly one of input_ids or inputs_embeds',
    'siglip2': 'real failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied (1344x224 and 768x64)',
    'speech-encoder-decoder': "batch failed: ModelLoadError: memcheck cannot build a batch for SpeechEncoderDecoderModel: its main input is 'inputs'; write a model file with build_model() and mak",
    'speech_to_text': "batch failed: ModelLoadError: memcheck cannot build a batch for Speech2TextForConditionalGeneration: its main input is 'input_features'; write a model file with bui",
    'squeezebert': 'build failed: ModelLoadError: cannot build SqueezeBertConfig for task None: If you want embedding_size != intermediate hidden_size, please insert a Conv1d layer to ',
    'textnet': 'real failed: RuntimeError: Given groups=1, weight of size [32, 16, 3, 3], expected input[2, 64, 320, 320] to have 16 channels, but got 64 channels instead',
    'timm_wrapper': 'build failed: ModelLoadError: cannot build TimmWrapperConfig for task None: TimmWrapperForImageClassification requires the timm library but it was not found in your',
    'tipsv2': "config failed: ValueError: out_features must be a subset of stage_names: ['stem', 'stage1', 'stage2'] got ['stage12']",
    'videoprism': 'batch failed: ModelLoadError: VideoPrismClipModel is no image-text model: its forward takes no input_ids, pixel_values and return_loss, which contrastive training f',
    'voxtral_realtime': 'real failed: ValueError: You must specify exactly one of input_features or encoder_inputs_embeds',
    'wav2vec2-bert': "build failed: ModelLoadError: cannot build Wav2Vec2BertConfig for task None: You are trying to instantiate <class 'transformers.models.wav2vec2_bert.modeling_wav2ve",
    'wav2vec2-conformer': "build failed: ModelLoadError: cannot build Wav2Vec2ConformerConfig for task None: You are trying to instantiate <class 'transformers.models.wav2vec2_conformer.model",
    'xlstm': 'real failed: ValueError: matC_old has wrong shape, got torch.Size([2, 4, 16, 16])',
    'xmod': 'real failed: ValueError: Input language unknown. Please call `XmodPreTrainedModel.set_default_language()`',
    'youtu': 'real failed: RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1',
    'zamba': "config failed: StrictDataclassClassValidationError: Class validation error for validator 'validate_layer_type':",
    'zamba2': "config failed: StrictDataclassClassValidationError: Class validation error for validator 'validate_layer_type':",
}
# expected failures that do not fail the same way every time (strict=False)
FLAKY: set[str] = set()


# The model types the expectations above were recorded with (transformers 5.23.0, the version
# the Makefile installs). A newer transformers brings architectures nobody has examined yet:
# they are expected to fail (not strictly) until they are.
RECORDED = {line.strip() for line in (Path(__file__).parent / "hf_coverage_model_types.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")}


# The census is the benchmark lane's (`make test-bench` runs every type). `make test` keeps a smoke
# sample: the common text families and one of each kind with CPU rules of its own (a convolution
# net, a CTC feature encoder, a state-space layer, MoE routing). Until issue 32's time budget it ran
# every 4th type and 28 more: 104 cases, 264 s of the suite's 1,860 s on the 2-core CI host.
ALWAYS = {"bert", "gpt2", "llama", "t5", "vit", "convnext", "wav2vec2", "mamba", "mixtral"}


def _params():
    out = []
    for case in cases():
        model_type = case[0]
        marks = [] if model_type in ALWAYS else [pytest.mark.bench]
        if model_type not in RECORDED:
            mark = pytest.mark.xfail(reason="new since transformers 5.23.0; not examined yet", strict=False)
            out.append(pytest.param(*case, marks=[mark, *marks], id=model_type))
        elif model_type in EXPECTED_FAILURES:
            mark = pytest.mark.xfail(reason=EXPECTED_FAILURES[model_type], strict=model_type not in FLAKY)
            out.append(pytest.param(*case, marks=[mark, *marks], id=model_type))
        else:
            out.append(pytest.param(*case, marks=marks, id=model_type))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model_type, architecture, task, label", _params())
def test_every_installed_architecture_estimate_matches_a_real_cpu_step(model_type, architecture, task, label):
    outcome = run_case(model_type, architecture, task, label)
    assert outcome.stage == "ok", f"{architecture} ({label}): {outcome.stage} failed: {outcome.message}"
    assert abs(outcome.error) <= TOLERANCE, (
        f"{architecture} ({label}): estimated {outcome.estimated_bytes} B, measured {outcome.measured_bytes} B "
        f"({outcome.error:+.2%})"
    )


def test_the_census_takes_every_task_mapping_once_per_model_type():
    """Each model type appears once, under the first task of ``TASKS`` whose mapping holds it."""
    from transformers.models.auto import modeling_auto

    from hf_coverage import TASKS

    found = cases()
    types = [c[0] for c in found]
    assert len(types) == len(set(types))
    every = set().union(*(getattr(modeling_auto, mapping) for mapping, _, _ in TASKS))
    assert set(types) == every
    # BERT has masked-LM, causal-LM and classification heads: masked LM comes first
    assert next(c for c in found if c[0] == "bert")[1:] == ("BertForMaskedLM", cases()[0][2].MASKED_LM, "masked-lm")
