// Raw tensor values moved between the Python tests and the emulation harnesses: each file holds one
// tensor's bytes, placed `offset` elements into a buffer of exactly offset + numel elements (the sanitizer
// sees any access past it; an offset of 1 misaligns it for the kernels' vector paths).
#pragma once

#include <cstddef>
#include <fstream>
#include <string>
#include <vector>

struct Buffer {
  std::vector<unsigned char> bytes;
  size_t offset_bytes = 0, size = 0;
  void* data() { return bytes.data() + offset_bytes; }
  template <class T>
  T* as() {
    return static_cast<T*>(data());
  }
};

// numel elements of elem bytes each, `offset` elements in, zeroed.
inline Buffer make_buffer(size_t elem, size_t numel, size_t offset) {
  Buffer b;
  b.bytes.assign((offset + numel) * elem, 0);
  b.offset_bytes = offset * elem;
  b.size = numel * elem;
  return b;
}

// false when the file is missing or shorter than the buffer.
inline bool load(const std::string& path, size_t elem, size_t numel, size_t offset, Buffer& b) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  b = make_buffer(elem, numel, offset);
  f.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(b.size));
  return static_cast<size_t>(f.gcount()) == b.size;
}

inline bool store(const std::string& path, Buffer& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size));
  return static_cast<bool>(f);
}
