// CRIU page images laid out by virtual address (see proc_pages.hpp).
#include "proc/proc_pages.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/hash.hpp"
#include "dvr/error.hpp"

namespace dvr::detail::procpages {

namespace {

constexpr std::uint32_t kImgCommonMagic = 0x54564319, kPagemapMagic = 0x56084025;  // CRIU's criu/include/magic.h

bool varint(const unsigned char*& p, const unsigned char* end, std::uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 64 && p < end; shift += 7) {
    unsigned char b = *p++;
    v |= static_cast<std::uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

// Calls f(field, value) for every varint field of one message; false on
// anything malformed. Other wire types are skipped.
template <class F>
bool fields(const unsigned char* p, const unsigned char* end, F&& f) {
  while (p < end) {
    std::uint64_t key = 0, v = 0;
    if (!varint(p, end, key)) return false;
    switch (key & 7) {
      case 0:
        if (!varint(p, end, v)) return false;
        f(key >> 3, v);
        break;
      case 1:
        if (end - p < 8) return false;
        p += 8;
        break;
      case 2:
        if (!varint(p, end, v) || static_cast<std::uint64_t>(end - p) < v) return false;
        p += v;
        break;
      case 5:
        if (end - p < 4) return false;
        p += 4;
        break;
      default:
        return false;
    }
  }
  return true;
}

}  // namespace

bool private_ranges(const char* data, std::size_t size, std::vector<std::pair<std::uint64_t, std::uint64_t>>& out) {
  // CRIU's criu/include/image.h (VMA_AREA_*) and mm.proto / vma.proto.
  constexpr std::uint64_t kRegular = 1u << 0, kFilePrivate = 1u << 6, kAnonPrivate = 1u << 9;
  constexpr std::uint64_t kSpecial = (1u << 2) | (1u << 3) | (1u << 7) | (1u << 8) | (1u << 10) | (1u << 11) | (1u << 12) |
                                     (1u << 13) | (1u << 14) | (1u << 15) | (1u << 16) | (1u << 17) | (1u << 27) | (1u << 31);
  constexpr std::uint64_t kMapHugetlb = 0x40000, kProtWrite = 0x2;
  out.clear();
  auto* p = reinterpret_cast<const unsigned char*>(data);
  const unsigned char* end = p + size;
  if (size < 12) return false;
  p += 8;  // the image-set magic and the mm magic
  std::uint32_t len;
  std::memcpy(&len, p, 4);
  p += 4;
  if (static_cast<std::uint64_t>(end - p) < len) return false;
  end = p + len;
  while (p < end) {  // MmEntry: only field 14 (vmas, messages) is looked into
    std::uint64_t key = 0, v = 0;
    if (!varint(p, end, key)) return false;
    const unsigned wire = key & 7;
    if (wire == 0) {
      if (!varint(p, end, v)) return false;
      continue;
    }
    if (wire == 1 || wire == 5) {
      const long skip = wire == 1 ? 8 : 4;
      if (end - p < skip) return false;
      p += skip;
      continue;
    }
    if (wire != 2 || !varint(p, end, v) || static_cast<std::uint64_t>(end - p) < v) return false;
    if ((key >> 3) == 14) {
      std::uint64_t start = 0, stop = 0, prot = 0, flags = 0, status = 0;
      if (!fields(p, p + v, [&](std::uint64_t f, std::uint64_t x) {
            if (f == 1) start = x;
            else if (f == 2) stop = x;
            else if (f == 5) prot = x;
            else if (f == 6) flags = x;
            else if (f == 7) status = x;
          }))
        return false;
      if (start >= stop || start % kPageSize || stop % kPageSize) return false;
      // Private anonymous memory, and the copy-on-write pages of a writable
      // private file mapping (a sealed heap of `dvr run --heap`, a library's data).
      const bool kind = (status & kAnonPrivate) || ((status & kFilePrivate) && (prot & kProtWrite));
      if ((status & kRegular) && kind && !(status & kSpecial) && !(flags & kMapHugetlb)) {
        if (!out.empty() && start < out.back().second) return false;  // unsorted
        if (!out.empty() && start == out.back().second)
          out.back().second = stop;
        else
          out.emplace_back(start, stop);
      }
    }
    p += v;
  }
  return true;
}

std::uint64_t Pagemap::present_bytes() const {
  std::uint64_t n = 0;
  for (auto& e : entries)
    if (e.present) n += e.pages * kPageSize;
  return n;
}

bool parse_pagemap(const char* data, std::size_t size, Pagemap& out) {
  auto* p = reinterpret_cast<const unsigned char*>(data);
  const unsigned char* end = p + size;
  if (size < 8) return false;
  p += 8;  // the image-set magic and the pagemap magic
  out = Pagemap{};
  bool head = true;
  while (p < end) {
    if (end - p < 4) return false;
    std::uint32_t len;
    std::memcpy(&len, p, 4);
    p += 4;
    if (static_cast<std::uint64_t>(end - p) < len) return false;
    if (head) {
      bool ok = fields(p, p + len, [&](std::uint64_t f, std::uint64_t v) {
        if (f == 1) out.pages_id = static_cast<std::uint32_t>(v);
      });
      if (!ok) return false;
      head = false;
    } else {
      Entry e;
      std::uint64_t flags = 0, compat_pages = 0;
      bool has_pages = false;
      bool ok = fields(p, p + len, [&](std::uint64_t f, std::uint64_t v) {
        if (f == 1) {
          e.vaddr = v;
        } else if (f == 2) {
          compat_pages = v;  // compat_nr_pages (uint32), all CRIU < 4.2 writes
        } else if (f == 4) {
          flags = v;
        } else if (f == 5) {
          e.pages = v;  // nr_pages (uint64), CRIU >= 4.2
          has_pages = true;
        }
      });
      if (!has_pages) e.pages = compat_pages;
      e.flags = static_cast<std::uint32_t>(flags);
      if (!ok || e.vaddr % kPageSize || e.pages == 0 || e.pages > (1ull << 40) / kPageSize) return false;
      // The entry must end inside the 64-bit address space (vaddr + bytes
      // must not wrap), and start at or after the previous one's end: both
      // compared without computing a sum that could wrap.
      if (e.vaddr > UINT64_MAX - e.pages * kPageSize + 1) return false;  // pages * kPageSize <= 2^40: no wrap here
      if (!out.entries.empty()) {
        const Entry& last = out.entries.back();
        if (e.vaddr < last.vaddr || e.vaddr - last.vaddr < last.pages * kPageSize) return false;  // overlapping or unsorted
      }
      e.present = (flags & kPePresent) != 0;
      out.entries.push_back(e);
    }
    p += len;
  }
  return !head;
}

bool Windows::build(const Pagemap& pm, int pages_fd, std::uint64_t file_size, bool writable, std::string* why) {
  if (pm.present_bytes() != file_size) {
    if (why) *why = "the pagemap accounts for " + std::to_string(pm.present_bytes()) + " bytes, the page image holds " + std::to_string(file_size);
    return false;
  }
  const int prot = PROT_READ | (writable ? PROT_WRITE : 0);
  const int file_flags = (writable ? MAP_SHARED : MAP_PRIVATE) | MAP_FIXED;
  auto window_at = [&](std::uint64_t start) -> char* {
    if (windows_.empty() || windows_.back().start != start) {
      try {
        maps_.push_back(Mapping::anonymous(kWindow, "for a window of a page image", prot));
      } catch (const Error& e) {
        if (why) *why = e.what();
        return nullptr;
      }
      windows_.push_back({start, maps_.back().data()});
    }
    return static_cast<char*>(windows_.back().base);
  };
  std::uint64_t offset = 0;  // in the page image
  for (auto& e : pm.entries) {
    if (!e.present) continue;
    std::uint64_t addr = e.vaddr, left = e.pages * kPageSize;
    while (left > 0) {
      std::uint64_t start = addr / kWindow * kWindow, in = addr - start;
      std::uint64_t len = std::min(left, kWindow - in);
      char* base = window_at(start);
      if (!base) return false;
      if (::mmap(base + in, len, prot, file_flags, pages_fd, static_cast<off_t>(offset)) == MAP_FAILED) {
        if (why) *why = std::string("cannot map the page image: ") + std::strerror(errno);
        return false;
      }
      addr += len;
      offset += len;
      left -= len;
    }
  }
  return true;
}

namespace {

void put_varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_message(std::string& out, const std::string& msg) {
  const auto len = static_cast<std::uint32_t>(msg.size());
  out.append(reinterpret_cast<const char*>(&len), 4);
  out += msg;
}

}  // namespace

std::string encode_pagemap(const Pagemap& pm) {
  std::string out;
  const std::uint32_t magic[2] = {kImgCommonMagic, kPagemapMagic};
  out.append(reinterpret_cast<const char*>(magic), sizeof magic);
  std::string msg;
  put_varint(msg, 1 << 3);  // pages_id = 1
  put_varint(msg, pm.pages_id);
  put_message(out, msg);
  for (auto& e : pm.entries) {
    msg.clear();
    put_varint(msg, 1 << 3);  // vaddr = 1
    put_varint(msg, e.vaddr);
    put_varint(msg, 2 << 3);  // compat_nr_pages = 2 (required): 0 when it does not fit, as CRIU 4.2 writes it
    put_varint(msg, e.pages <= 0xffffffffu ? e.pages : 0);
    put_varint(msg, 4 << 3);  // flags = 4
    put_varint(msg, e.flags);
    put_varint(msg, 5 << 3);  // nr_pages = 5
    put_varint(msg, e.pages);
    put_message(out, msg);
  }
  return out;
}

std::string window_region(std::uint32_t pages_id, std::uint64_t start) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "mem-%u-%016llx", pages_id, static_cast<unsigned long long>(start));
  return buf;
}

}  // namespace dvr::detail::procpages
