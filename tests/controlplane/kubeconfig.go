package main

import (
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

const (
	kubeconfigCluster = "edgefleet-test"
	kubeconfigContext = "edgefleet-test"
)

// writeKubeconfig writes an admin kubeconfig for serverURL. The current
// context authenticates with the static bearer token; a second context,
// "edgefleet-test-cert", uses the admin client certificate instead.
func writeKubeconfig(path, serverURL string, p *pki) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[kubeconfigCluster] = &clientcmdapi.Cluster{
		Server:                   serverURL,
		CertificateAuthorityData: p.caPEM,
	}
	cfg.AuthInfos[p.AdminUser] = &clientcmdapi.AuthInfo{Token: p.AdminToken}
	cfg.AuthInfos[p.AdminUser+"-cert"] = &clientcmdapi.AuthInfo{
		ClientCertificateData: p.adminCertPEM,
		ClientKeyData:         p.adminKeyPEM,
	}
	cfg.Contexts[kubeconfigContext] = &clientcmdapi.Context{
		Cluster:   kubeconfigCluster,
		AuthInfo:  p.AdminUser,
		Namespace: "default",
	}
	cfg.Contexts[kubeconfigContext+"-cert"] = &clientcmdapi.Context{
		Cluster:   kubeconfigCluster,
		AuthInfo:  p.AdminUser + "-cert",
		Namespace: "default",
	}
	cfg.CurrentContext = kubeconfigContext
	data, err := clientcmd.Write(*cfg)
	if err != nil {
		return err
	}
	return writeFile(path, data, 0o600)
}
