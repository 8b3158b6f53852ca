// A Maya-style scene tool on a dvr::Arena: flip between scene variants by
// restoring snapshots of a pointer-rich scene graph instead of reloading it.
//
//   build/dvr-example-scene [--mib 300] [--rounds 3] [--store DIR] [--json]
//
// It builds a synthetic scene of about --mib MiB in an arena (meshes as
// std::pmr::vectors, materials shared by pointer, a node hierarchy with
// parent/child pointers, string names), saves it to a scene file, snapshots
// `base`, applies effect A (deforms 5% of the meshes) and snapshots `fx-a`,
// restores `base`, applies effect B (scales another 5%) and snapshots `fx-b`,
// then flips between the three variants, checking the scene's checksum
// (every pointer walked, every byte of mesh data summed) after each flip. It
// prints the time to reload the scene file into a fresh arena against the
// time to restore a variant (with --json, one object per line:
// {"name","value","unit","peer","peer_value","ratio" (peer/value)}).
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory_resource>
#include <string>
#include <vector>

#include "dvr/dvr.hpp"

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Material {
  std::pmr::string name;
  float color[4];
  float roughness;
  explicit Material(std::pmr::memory_resource* r) : name(r) {}
};

struct Node;

struct Mesh {
  std::pmr::string name;
  std::pmr::vector<float> positions;  // x, y, z per vertex
  std::pmr::vector<float> normals;
  std::pmr::vector<std::uint32_t> indices;  // three per triangle
  Material* material = nullptr;
  Node* node = nullptr;
  explicit Mesh(std::pmr::memory_resource* r) : name(r), positions(r), normals(r), indices(r) {}
};

struct Node {
  std::pmr::string name;
  Node* parent = nullptr;
  std::pmr::vector<Node*> children;
  float transform[16];
  Mesh* mesh = nullptr;
  explicit Node(std::pmr::memory_resource* r) : name(r), children(r) {}
};

struct Scene {
  std::pmr::vector<Node*> nodes;
  std::pmr::vector<Mesh*> meshes;
  std::pmr::vector<Material*> materials;
  Node* root = nullptr;
  explicit Scene(std::pmr::memory_resource* r) : nodes(r), meshes(r), materials(r) {}
};

constexpr std::size_t kVertices = 20000;  // per mesh: ~0.9 MiB with normals and indices

Node* add_node(dvr::Arena& a, Scene& s, Node* parent, const std::string& name) {
  Node* n = dvr::make<Node>(a, &a);
  n->name = name;
  n->parent = parent;
  for (int k = 0; k < 16; ++k)
    n->transform[k] = k % 5 == 0 ? 1.f : 0.f;
  if (parent) parent->children.push_back(n);
  s.nodes.push_back(n);
  return n;
}

Scene* build_scene(dvr::Arena& a, std::size_t mib) {
  Scene* s = dvr::make<Scene>(a, &a);
  const std::size_t meshes = std::max<std::size_t>(8, (mib << 20) / (kVertices * (6 * 4 + 6 * 4)));
  for (int m = 0; m < 32; ++m) {
    Material* mat = dvr::make<Material>(a, &a);
    mat->name = "material-" + std::to_string(m);
    for (int k = 0; k < 4; ++k)
      mat->color[k] = static_cast<float>((m * 7 + k) % 10) / 10.f;
    mat->roughness = static_cast<float>(m) / 32.f;
    s->materials.push_back(mat);
  }
  s->root = add_node(a, *s, nullptr, "world");
  std::vector<Node*> groups;
  for (std::size_t g = 0; g < (meshes + 15) / 16; ++g)
    groups.push_back(add_node(a, *s, s->root, "group-" + std::to_string(g)));
  for (std::size_t m = 0; m < meshes; ++m) {
    Mesh* mesh = dvr::make<Mesh>(a, &a);
    mesh->name = "mesh-" + std::to_string(m) + "-character-part";
    mesh->positions.resize(kVertices * 3);
    mesh->normals.resize(kVertices * 3);
    for (std::size_t v = 0; v < kVertices; ++v) {
      float t = static_cast<float>(v) * 0.001f + static_cast<float>(m);
      mesh->positions[3 * v] = std::cos(t) * (1 + m % 7);
      mesh->positions[3 * v + 1] = std::sin(t) * (1 + m % 5);
      mesh->positions[3 * v + 2] = t * 0.01f;
      mesh->normals[3 * v] = std::cos(t);
      mesh->normals[3 * v + 1] = std::sin(t);
      mesh->normals[3 * v + 2] = 0;
    }
    mesh->indices.resize((kVertices - 2) * 3);
    for (std::size_t tri = 0; tri + 2 < kVertices; ++tri) {
      mesh->indices[3 * tri] = static_cast<std::uint32_t>(tri);
      mesh->indices[3 * tri + 1] = static_cast<std::uint32_t>(tri + 1);
      mesh->indices[3 * tri + 2] = static_cast<std::uint32_t>(tri + 2);
    }
    mesh->material = s->materials[m % s->materials.size()];
    Node* n = add_node(a, *s, groups[m / 16], "node-" + std::to_string(m));
    n->mesh = mesh;
    mesh->node = n;
    s->meshes.push_back(mesh);
  }
  return s;
}

// Every pointer walked and checked, every byte of mesh data summed.
std::uint64_t checksum(const dvr::Arena& a, const Scene* s) {
  auto check = [&](const void* p) {
    if (!a.contains(p)) throw std::runtime_error("a scene pointer leads out of the arena");
  };
  std::uint64_t sum = 1469598103934665603ull;
  auto mix = [&](const void* data, std::size_t n) {
    const auto* w = static_cast<const unsigned char*>(data);
    std::uint64_t acc = 0;
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      std::uint64_t x;
      std::memcpy(&x, w + i, 8);
      acc = acc * 0x100000001b3ull + x;
    }
    for (; i < n; ++i)
      acc = acc * 31 + w[i];
    sum = (sum ^ acc) * 1099511628211ull;
  };
  for (const Node* n : s->nodes) {
    check(n);
    mix(n->name.data(), n->name.size());
    mix(n->transform, sizeof n->transform);
    if (n->parent) {
      check(n->parent);
      bool listed = false;
      for (const Node* c : n->parent->children)
        listed = listed || c == n;
      if (!listed) throw std::runtime_error("node " + std::string(n->name) + " is not among its parent's children");
    }
    for (const Node* c : n->children)
      if (c->parent != n) throw std::runtime_error("a child of " + std::string(n->name) + " names another parent");
    if (n->mesh && n->mesh->node != n) throw std::runtime_error("mesh and node disagree");
  }
  for (const Mesh* m : s->meshes) {
    check(m);
    check(m->material);
    mix(m->name.data(), m->name.size());
    mix(m->positions.data(), m->positions.size() * sizeof(float));
    mix(m->normals.data(), m->normals.size() * sizeof(float));
    mix(m->indices.data(), m->indices.size() * sizeof(std::uint32_t));
    mix(m->material->name.data(), m->material->name.size());
  }
  return sum;
}

// Effect A: deform every 20th mesh (5%). Effect B: scale another 5%.
void effect_a(Scene* s) {
  for (std::size_t m = 0; m < s->meshes.size(); m += 20)
    for (std::size_t v = 0; v < kVertices; ++v)
      s->meshes[m]->positions[3 * v + 2] += 0.05f * std::sin(static_cast<float>(v) * 0.01f);
}
void effect_b(Scene* s) {
  for (std::size_t m = 10; m < s->meshes.size(); m += 20) {
    for (auto& p : s->meshes[m]->positions)
      p *= 1.5f;
    s->meshes[m]->name += "-scaled";
  }
}

// The scene file: a flat binary dump (materials, nodes by index, meshes).
void save(const Scene* s, const std::string& file) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  auto put = [&](const void* p, std::size_t n) { out.write(static_cast<const char*>(p), static_cast<std::streamsize>(n)); };
  auto u64 = [&](std::uint64_t v) { put(&v, 8); };
  auto str = [&](const std::pmr::string& x) {
    u64(x.size());
    put(x.data(), x.size());
  };
  auto index_of = [](const auto& vec, const auto* p) -> std::uint64_t {
    for (std::size_t i = 0; i < vec.size(); ++i)
      if (vec[i] == p) return i;
    return ~0ull;
  };
  u64(s->materials.size());
  for (auto* m : s->materials) {
    str(m->name);
    put(m->color, sizeof m->color);
    put(&m->roughness, sizeof m->roughness);
  }
  u64(s->nodes.size());
  for (std::size_t i = 0; i < s->nodes.size(); ++i) {
    const Node* n = s->nodes[i];
    str(n->name);
    u64(n->parent
            ? static_cast<std::uint64_t>(std::find(s->nodes.begin(), s->nodes.begin() + static_cast<std::ptrdiff_t>(i), n->parent) - s->nodes.begin())
            : ~0ull);
    put(n->transform, sizeof n->transform);
  }
  u64(s->meshes.size());
  for (auto* m : s->meshes) {
    str(m->name);
    u64(index_of(s->materials, m->material));
    u64(index_of(s->nodes, m->node));
    u64(m->positions.size());
    put(m->positions.data(), m->positions.size() * sizeof(float));
    put(m->normals.data(), m->normals.size() * sizeof(float));
    u64(m->indices.size());
    put(m->indices.data(), m->indices.size() * sizeof(std::uint32_t));
  }
  if (!out) throw std::runtime_error("cannot write scene file " + file);
}

Scene* load(dvr::Arena& a, const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  auto get = [&](void* p, std::size_t n) {
    if (!in.read(static_cast<char*>(p), static_cast<std::streamsize>(n))) throw std::runtime_error("scene file " + file + " is truncated");
  };
  auto u64 = [&] {
    std::uint64_t v;
    get(&v, 8);
    return v;
  };
  auto str = [&](std::pmr::string& x) {
    x.resize(u64());
    get(x.data(), x.size());
  };
  Scene* s = dvr::make<Scene>(a, &a);
  for (std::uint64_t k = 0, n = u64(); k < n; ++k) {
    Material* m = dvr::make<Material>(a, &a);
    str(m->name);
    get(m->color, sizeof m->color);
    get(&m->roughness, sizeof m->roughness);
    s->materials.push_back(m);
  }
  for (std::uint64_t k = 0, n = u64(); k < n; ++k) {
    Node* x = dvr::make<Node>(a, &a);
    str(x->name);
    std::uint64_t parent = u64();
    get(x->transform, sizeof x->transform);
    if (parent != ~0ull) {
      x->parent = s->nodes.at(parent);
      x->parent->children.push_back(x);
    } else {
      s->root = x;
    }
    s->nodes.push_back(x);
  }
  for (std::uint64_t k = 0, n = u64(); k < n; ++k) {
    Mesh* m = dvr::make<Mesh>(a, &a);
    str(m->name);
    m->material = s->materials.at(u64());
    m->node = s->nodes.at(u64());
    m->node->mesh = m;
    m->positions.resize(u64());
    get(m->positions.data(), m->positions.size() * sizeof(float));
    m->normals.resize(m->positions.size());
    get(m->normals.data(), m->normals.size() * sizeof(float));
    m->indices.resize(u64());
    get(m->indices.data(), m->indices.size() * sizeof(std::uint32_t));
    s->meshes.push_back(m);
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t mib = 300;
  int rounds = 3;
  bool json = false;
  std::string store_dir;
  // A whole number from 1 to `most`, or the usage line (exit 2).
  auto number = [&](const char* option, const char* text, long most) {
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || v < 1 || v > most) {
      std::fprintf(stderr, "%s: %s '%s' is not a whole number from 1 to %ld\n", argv[0], option, text, most);
      std::exit(2);
    }
    return v;
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--mib" && i + 1 < argc)
      mib = static_cast<std::size_t>(number("--mib", argv[++i], 1 << 20));
    else if (a == "--rounds" && i + 1 < argc)
      rounds = static_cast<int>(number("--rounds", argv[++i], 1000000));
    else if (a == "--store" && i + 1 < argc)
      store_dir = argv[++i];
    else if (a == "--json")
      json = true;
    else {
      std::fprintf(stderr, "usage: %s [--mib 300] [--rounds 3] [--store DIR] [--json]\n", argv[0]);
      return 2;
    }
  }
  namespace fs = std::filesystem;
  const bool own_store = store_dir.empty();
  fs::path work = fs::temp_directory_path();
  if (fs::is_directory("/dev/shm")) work = "/dev/shm";
  work /= "dvr-scene-" + std::to_string(::getpid());
  fs::create_directories(work);
  if (own_store) store_dir = (work / "store").string();
  int status = 0;
  try {
    dvr::Store store = dvr::Store::open(store_dir);
    dvr::Session session(store, "scene");
    dvr::Arena arena(session, "scene");
    auto t = Clock::now();
    Scene* scene = build_scene(arena, mib);
    arena.set_root(scene);
    const double build_s = since(t);
    const std::string file = (work / "scene.bin").string();
    save(scene, file);
    const std::uint64_t base_sum = checksum(arena, scene);

    // The peer: reloading the scene file into a fresh arena (best of rounds).
    double reload_s = 1e9;
    for (int r = 0; r < rounds; ++r) {
      dvr::Session other(store, "scene-reload");
      dvr::ArenaOptions o;
      o.address = 0x6f0000000000;
      dvr::Arena fresh(other, "scene", o);
      auto t0 = Clock::now();
      Scene* again = load(fresh, file);
      reload_s = std::min(reload_s, since(t0));
      if (checksum(fresh, again) != base_sum) throw std::runtime_error("the reloaded scene differs from the saved one");
    }

    session.snapshot("base", {.replace = true});
    effect_a(scene);
    const std::uint64_t a_sum = checksum(arena, scene);
    session.snapshot("fx-a", {.replace = true});
    arena.restore("base");
    effect_b(arena.root_as<Scene>());
    const std::uint64_t b_sum = checksum(arena, arena.root_as<Scene>());
    session.snapshot("fx-b", {.replace = true});
    if (a_sum == base_sum || b_sum == base_sum || a_sum == b_sum) throw std::runtime_error("the effects changed nothing");

    struct Variant {
      const char* name;
      std::uint64_t sum;
      double best = 1e9;
    } variants[] = {{"fx-a", a_sum}, {"base", base_sum}, {"fx-b", b_sum}};
    int flips = 0;
    for (int r = 0; r < rounds; ++r)
      for (auto& v : variants) {
        auto t0 = Clock::now();
        arena.restore(v.name);
        v.best = std::min(v.best, since(t0));
        ++flips;
        if (checksum(arena, arena.root_as<Scene>()) != v.sum)
          throw std::runtime_error(std::string("after restoring ") + v.name + " the scene's checksum is wrong");
      }
    double restore_s = 0;
    for (auto& v : variants)
      restore_s = std::max(restore_s, v.best);  // the slowest variant's best

    if (json) {
      std::printf(
          "{\"name\":\"restore_variant\",\"value\":%.6f,\"unit\":\"s\",\"peer\":\"reload scene file\",\"peer_value\":%.6f,"
          "\"ratio\":%.1f,\"bytes\":%zu,\"meshes\":%zu}\n",
          restore_s, reload_s, reload_s / restore_s, arena.used(), scene->meshes.size());
      for (auto& v : variants)
        std::printf(
            "{\"name\":\"restore_%s\",\"value\":%.6f,\"unit\":\"s\",\"peer\":\"reload scene file\",\"peer_value\":%.6f,"
            "\"ratio\":%.1f}\n",
            v.name, v.best, reload_s, reload_s / v.best);
    } else {
      std::printf("scene: %zu meshes, %zu nodes, %.0f MiB in the arena at %p (built in %.2f s)\n", scene->meshes.size(), scene->nodes.size(),
                  static_cast<double>(arena.used()) / (1 << 20), arena.base(), build_s);
      std::printf("reload from the scene file: %8.1f ms\n", reload_s * 1e3);
      for (auto& v : variants)
        std::printf("restore %-6s            %8.2f ms  (%.0fx faster)\n", v.name, v.best * 1e3, reload_s / v.best);
      std::printf("%d flips, every one checked: all pointers walked, all mesh data summed\n", flips);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dvr-example-scene: %s\n", e.what());
    status = 1;
  }
  std::error_code ec;
  if (own_store)
    fs::remove_all(work, ec);
  else
    fs::remove(work / "scene.bin", ec), fs::remove(work, ec);
  return status;
}
