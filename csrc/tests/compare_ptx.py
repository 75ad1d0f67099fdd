"""Compare the PTX of every kernel between two builds, names normalised (mangling, anonymous namespaces, labels,
shared-memory symbols): a restructuring of csrc/ that must not change a single instruction is checked without a GPU.

  nvcc -O3 --use_fast_math -std=c++17 -Icsrc/include -ptx -arch=sm_90 -o new_prefix.ptx csrc/prefix.cu   (each .cu)
  python csrc/tests/compare_ptx.py old.ptx[,old2.ptx] new_prefix.ptx,new_suffix.ptx,new_merge.ptx ["kernel to diff"]

Prints DIFF for each kernel whose instructions differ and exits 1 if any does.
"""
import re, subprocess, sys
def demangle(n):
    d = subprocess.run(["c++filt", n], capture_output=True, text=True).stdout.strip()
    # prefix_v2_kernel: the name of the prefix kernel before csrc/ was split (ABI 2)
    d = d.replace("(anonymous namespace)::", "").replace("hfc::", "").replace("prefix_v2_kernel", "prefix_kernel")
    return re.sub(r"\(.*", "", d)
def kernels(paths):
    out = {}
    for p in paths:
        txt = open(p).read()
        for m in re.finditer(r"^(?:\.visible |\.weak )?\.entry (\w+)\((.*?)^\}", txt, re.S | re.M):
            name = m.group(1)
            body = m.group(2).replace(name, "KERNEL")
            body = re.sub(r"\.file.*|\.loc.*|//.*", "", body)
            body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
            body = re.sub(r"_Z\w*?(4smemE|5red_[olm]\b)", r"SHARED_\1", body)
            out[demangle(name)] = [l.strip() for l in body.split("\n") if l.strip()]
    return out
a = kernels(sys.argv[1].split(","))
b = kernels(sys.argv[2].split(","))
same = diff = 0
for k in sorted(b):
    if k not in a:
        print("only new:", k); diff += 1; continue
    if a[k] == b[k]: same += 1
    else:
        diff += 1; print("DIFF", k)
for k in sorted(a):
    if k not in b: print("only old:", k)
print(f"{same} kernels identical, {diff} differ, {len(a)} old kernels")
if len(sys.argv) > 3:
    import difflib
    k = sys.argv[3]
    for l in list(difflib.unified_diff(a[k], b[k], lineterm="", n=0))[:30]: print(l)
sys.exit(1 if diff else 0)
