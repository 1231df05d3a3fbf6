"""The Triton kernels compiled ahead of time for a GPU that is not here: Triton's compiler
needs no GPU, so a machine without one (the tests, `scripts/gpu_check.sh --rehearse` with the
GPU machine's Triton) proves each kernel compiles for sm_90 at the launch configurations the
serving path uses: float32/bfloat16/float16, decode and prefill rows, with and without split
context, sliding window and soft-capping, the reduction, store and copy kernels, and the fused
per-layer ops (both norms, SiLU-and-multiply, rotary in the K/V store).

`compile_all(arch=90)` compiles them all and returns how many; the first that does not
compile raises (Triton's own error). Integer arguments are compiled as i32 without
specialization, as do_not_specialize leaves them."""
from __future__ import annotations


def compile_all(arch: int = 90) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedserve.kernels.copy_blocks_triton import _copy_blocks_kernel
    from pagedserve.kernels.fused_triton import _rms_norm_kernel, _silu_and_mul_kernel
    from pagedserve.kernels.paged_attention_triton import _paged_attention_kernel, _reduce_splits_kernel
    from pagedserve.kernels.rotary_store_triton import _rotary_store_kernel
    from pagedserve.kernels.store_kv_triton import _store_kv_kernel

    target = GPUTarget("cuda", arch, 32)
    count = 0

    def compile_one(kernel, pointers, constants):
        nonlocal count
        signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in kernel.arg_names}
        constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=target)
        assert compiled.asm["ptx"], kernel.__name__
        count += 1

    for dtype, precision in (("fp32", "ieee"), ("bf16", "tf32"), ("fp16", "tf32")):
        pointers = {name: "*" + dtype for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
        pointers.update(block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32",
                        part_acc_ptr="*fp32", part_ml_ptr="*fp32", qk_scale="fp32", cap_in="fp32", cap_out="fp32")
        for block_m, block_q, head, tile, per_tile, splits, windowed in (
                (16, 1, 128, 64, 4, 1, False), (16, 1, 128, 64, 2, 8, False), (64, 8, 64, 64, 4, 1, False),
                (64, 16, 128, 64, 2, 1, False), (16, 1, 128, 64, 4, 8, True), (64, 16, 128, 64, 2, 1, True)):
            compile_one(_paged_attention_kernel, pointers, dict(
                GROUP=block_m // block_q, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_SIZE=head, HEAD_PAD=head,
                BLOCK_SIZE=tile // per_tile, TILE=tile, BLOCKS_PER_TILE=per_tile, SPLIT=splits > 1,
                NUM_HEADS=32, DOT_PRECISION=precision, HAS_WINDOW=windowed, HAS_SOFTCAP=windowed))
        compile_one(_reduce_splits_kernel, dict(out_ptr="*" + dtype, part_acc_ptr="*fp32", part_ml_ptr="*fp32"),
                    dict(NUM_HEADS=32, SPLITS_PAD=8, HEAD_SIZE=128, HEAD_PAD=128))
    pointers = {name: "*bf16" for name in ("key_ptr", "value_ptr", "k_ptr", "v_ptr")}
    compile_one(_store_kv_kernel, dict(pointers, slot_mapping_ptr="*i64"), dict(
        NUM_KV_HEADS=3, HEAD_SIZE=64, HEADS_PAD=4, HEAD_PAD=64, BLOCK_SIZE=16))
    pointers = dict(src_ptr="*bf16", dst_ptr="*bf16", src_ids_ptr="*i64", dst_ids_ptr="*i64",
                    stride_srcb="i64", stride_dstb="i64")
    compile_one(_copy_blocks_kernel, pointers, dict(CHUNK=4096))
    for dtype in ("fp32", "bf16", "fp16"):  # the fused per-layer ops: Llama's norms, Gemma's, SiLU, rotary
        pointers = dict(x_ptr="*" + dtype, r_ptr="*" + dtype, w_ptr="*" + dtype, out_ptr="*" + dtype, eps="fp32")
        for add, round_first in ((False, True), (True, True)):
            compile_one(_rms_norm_kernel, pointers, dict(ADD=add, ROUND_FIRST=round_first, BLOCK=2048))
        compile_one(_rms_norm_kernel, dict(pointers, w_ptr="*fp32"), dict(ADD=False, ROUND_FIRST=False, BLOCK=4096))
        compile_one(_silu_and_mul_kernel, dict(gu_ptr="*" + dtype, out_ptr="*" + dtype), dict(BLOCK=1024))
        pointers = {name: "*" + dtype for name in ("qk_ptr", "v_ptr", "cos_ptr", "sin_ptr", "k_ptr", "vc_ptr")}
        compile_one(_rotary_store_kernel, dict(pointers, slot_mapping_ptr="*i64"), dict(
            Q_HEADS=32, KV_HEADS=8, HALF=64, Q_PAD=32, KV_PAD=8, HALF_PAD=64, BLOCK_SIZE=16))
    return count
