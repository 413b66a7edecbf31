package main

import (
	"fmt"
	"net/url"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

// startEtcd starts a single-member embedded etcd that listens on free
// loopback ports only, and returns once it serves requests. The returned
// URL is the client endpoint for kube-apiserver's --etcd-servers.
func startEtcd(dataDir string, logOutput string, logLevel string) (*embed.Etcd, string, error) {
	cfg := embed.NewConfig()
	cfg.Name = "edgefleet-test"
	cfg.Dir = dataDir

	// Port 0: the kernel picks a free port when the listener is bound. The
	// advertised peer URL stays "http://127.0.0.1:0", which is harmless for a
	// single member (nobody dials it) and stays identical across restarts on
	// the same data dir, so etcd's membership check is satisfied.
	loopback := url.URL{Scheme: "http", Host: "127.0.0.1:0"}
	cfg.ListenClientUrls = []url.URL{loopback}
	cfg.AdvertiseClientUrls = []url.URL{loopback}
	cfg.ListenPeerUrls = []url.URL{loopback}
	cfg.AdvertisePeerUrls = []url.URL{loopback}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.ListenMetricsUrls = nil

	// A throwaway test store: skip fsync, no HTTP/JSON gateway.
	cfg.UnsafeNoFsync = true
	cfg.EnableGRPCGateway = false

	cfg.Logger = "zap"
	cfg.LogLevel = logLevel
	cfg.LogOutputs = []string{logOutput}

	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, "", fmt.Errorf("starting embedded etcd: %w", err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		return nil, "", fmt.Errorf("embedded etcd failed: %w", err)
	case <-time.After(60 * time.Second):
		e.Server.Stop()
		e.Close()
		return nil, "", fmt.Errorf("embedded etcd did not become ready within 60s")
	}
	if len(e.Clients) == 0 {
		e.Close()
		return nil, "", fmt.Errorf("embedded etcd has no client listener")
	}
	return e, "http://" + e.Clients[0].Addr().String(), nil
}
