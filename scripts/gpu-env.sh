# Sourced by the GPU scripts: put libnvrtc/libcublas (CUDA toolkit first, then pip's nvidia-*
# wheels) and the driver's folder on LD_LIBRARY_PATH, so ferrite's run-time loading finds them.
# Folders holding a library, toolkit first (its NVRTC matches the installed nvcc and driver).
lib_dir() {
    local name=$1 roots=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64)
    if command -v python3 >/dev/null; then
        roots+=($(python3 -c 'import site,sys; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null))
    fi
    for r in "${roots[@]}"; do
        [ -d "$r" ] || continue
        local hit
        hit=$(find -L "$r" -maxdepth 4 -name "$name" 2>/dev/null | head -n1)
        [ -n "$hit" ] && { dirname "$hit"; return; }
    done
}
extra=""
for lib in 'libnvrtc.so.1[0-9]*' 'libcublas.so.1[0-9]*' 'libcublasLt.so.1[0-9]*'; do
    d=$(lib_dir "$lib")
    if [ -n "$d" ]; then
        case ":$extra:" in *":$d:"*) ;; *) extra="$extra:$d" ;; esac
    else
        echo "warning: $lib not found under the CUDA toolkit or pip's nvidia wheels" >&2
    fi
done
[ -d /usr/local/nvidia/lib64 ] && extra="$extra:/usr/local/nvidia/lib64"
export LD_LIBRARY_PATH="${extra#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
