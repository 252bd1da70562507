import sys, dataclasses, torch
from rtcompile.kernels.triton_fwd import running_tensor_fwd
from rtcompile.kernels.variants import ChunkVariant, KernelShape
from rtcompile.kernels.reference import running_tensor_chunk_ref
w = tuple(int(x) for x in sys.argv[1].split("x")); fused = sys.argv[2] == "1"; B, T = int(sys.argv[3]), int(sys.argv[4])
var = ChunkVariant.default(KernelShape(w, 64), torch.cuda.get_device_properties(0).shared_memory_per_block_optin)
var = dataclasses.replace(var, fuse_prepare=fused)
g = torch.Generator(device="cuda").manual_seed(0)
r = lambda *s: torch.randn(*s, device="cuda", generator=g)
q = [r(B, T, 8, d).bfloat16() for d in w]; k = [r(B, T, 8, d).bfloat16() for d in w]; v = r(B, T, 8, 64).bfloat16()
gg = torch.nn.functional.logsigmoid(r(B, T, 8)); beta = torch.sigmoid(r(B, T, 8)).bfloat16()
o, s = running_tensor_fwd(q, k, v, gg, beta, output_final_state=True, l2norm=True, variant=var)
torch.cuda.synchronize()
msg = f"{sys.argv[1]} fused={fused} B{B} T{T} {var} ok finite={bool(torch.isfinite(o).all())}"
if T <= 256:
    up = lambda x: x.double().cpu()
    o_ref, _ = running_tensor_chunk_ref([up(x) for x in q], [up(x) for x in k], up(v), up(gg), up(beta), output_final_state=True, l2norm=True)
    msg += f" rel_rms={float(((o.double().cpu()-o_ref).pow(2).mean()/o_ref.pow(2).mean()).sqrt()):.1e}"
print(msg)
